"""The ML4 text model (spec §3.1): embed, decoder layers (MLA + dense/MoE FFN), final norm, head, soft cap."""

from __future__ import annotations

import torch
from torch import nn

from .attention import MLA, AttentionBatch
from .batch import ForwardTrace, Segment, segment_positions, segment_slices
from .config import LayerSpec, ModelConfig
from .dspark import DSpark
from .kv import LatentKV
from .moe import MoE, SwiGLU
from .norm import RMSNorm
from .rope import LeRoPE, rope_cos_sin, rope_frequencies


class Block(nn.Module):
    """One decoder layer: `layers.N.*`. MoE tensors sit under `layers.N.` in checkpoints (see weights.py)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MLA(cfg, spec)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if spec.ffn == "dense":
            self.feed_forward = SwiGLU(cfg.dim, cfg.hidden_dim)
        else:
            self.moe = MoE(cfg)

    def forward(self, h: torch.Tensor, b: AttentionBatch) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), b)
        ffn = self.feed_forward if self.spec.ffn == "dense" else self.moe
        return h + ffn(self.ffn_norm(h))


class ML4(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.lerope = LeRoPE(cfg.qk_rope_head_dim)
        self.layers = nn.ModuleList(Block(cfg, spec) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tied_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp_dspark = DSpark(cfg) if cfg.mtp else None   # the drafter (`mtp_dspark.*`); not run by forward

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and soft cap: h [n, D] -> logits [n, V] (fp32, or fp64 in tests)."""
        w = self.tok_embeddings.weight if self.output is None else self.output.weight
        z = torch.nn.functional.linear(self.norm(h), w)
        z = z.float() if z.dtype != torch.float64 else z
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(z / cap) if cap else z

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, segments: list[Segment], kv: LatentKV,
                logits_at: torch.Tensor | None = None, trace: ForwardTrace | None = None) -> torch.Tensor:
        """tokens [N] (segments concatenated) -> logits [N, V], or [len(logits_at), V] for those rows only.

        Every segment's earlier positions must already be in `kv` (chunked prefill / decode continue there).
        """
        positions = segment_positions(segments, self.device)
        cos, sin = rope_cos_sin(rope_frequencies(self.cfg, self.lerope.alpha), positions, self.dtype)
        b = AttentionBatch(segments, segment_slices(segments), positions, kv, cos, sin, {}, trace)
        kv.begin_step(segments)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, b)
            if trace is not None and layer.spec.index in trace.tap_layers:
                trace.taps[layer.spec.index] = h
        kv.end_step()
        return self.head(h if logits_at is None else h[logits_at])
