"""The ML4 text model (spec §3.1): embed, decoder layers (MLA + dense/MoE FFN), final norm, head, soft cap."""

from __future__ import annotations

import torch
from torch import nn

from .attention import MLA, AttentionBatch, Queries
from ..core.batch import ForwardTrace, Segment, segment_positions
from ..core.config import LayerSpec, ModelConfig
from .dspark import DSpark
from ..kv.base import LatentKV
from .linear import Linear
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

    def forward(self, h: torch.Tensor, b: AttentionBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, D] -> [N, D]; with `keep` (ascending row indices), the layer caches every row but computes only
        the kept ones -> [len(keep), D], and narrows `b` to them for the layers after it."""
        attn = self.attention
        x = self.attention_norm(h)
        cos, sin = attn.rope_tables(b)
        attn.store(*attn.cache_rows(x, cos, sin), b)
        if keep is not None:
            h, x = h[keep], x[keep]
            cos, sin = (None, None) if cos is None else (cos[keep], sin[keep])
            b.narrow_(keep)
        if not h.shape[0]:       # no row left to compute (a prefill chunk that needs no logits)
            return h
        return self.feed_forward_residual(h + attn(x, b, cos, sin))

    # The layer in the three parts a piecewise CUDA graph runs (hisparse.engine.cuda_graphs): `project` and
    # `finish` are dense with the batch's static shapes, `seam` makes every LatentKV call.
    def project(self, h: torch.Tensor, b: AttentionBatch
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, Queries]:
        """h [N, D] -> what the seam needs: latent rows, indexer keys (None where not cached), queries."""
        x = self.attention_norm(h)
        cos, sin = self.attention.rope_tables(b)
        return *self.attention.cache_rows(x, cos, sin), self.attention.queries(x, b, cos, sin)

    def seam(self, rows: torch.Tensor | None, keys: torch.Tensor | None, q: Queries, b: AttentionBatch
             ) -> torch.Tensor:
        """Store this layer's rows and keys, then attend: olat [N, H, r]."""
        self.attention.store(rows, keys, b)
        return self.attention.attend(q, b)

    def finish(self, h: torch.Tensor, olat: torch.Tensor) -> torch.Tensor:
        """Residual stream h [N, D] and the seam's olat [N, H, r] -> the layer's output [N, D]."""
        return self.feed_forward_residual(h + self.attention.output(olat))

    def feed_forward_residual(self, h: torch.Tensor) -> torch.Tensor:
        """h + FFN(norm(h)): the dense or MoE half of the layer, [N, D] -> [N, D]."""
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
        self.output = None if cfg.tied_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp_dspark = DSpark(cfg) if cfg.mtp else None   # the drafter (`mtp_dspark.*`); not run by forward
        # From the last layer that caches anything (latents or indexer keys), only rows that need logits matter
        self.last_writer = max(s.index for s in cfg.layers if s.kv_owner or s.index_owner)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def logits_dtype(self) -> torch.dtype:
        """The logits' dtype: fp32 (fp64 for an fp64 model, the exactness reference)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def use_kernels(self, path: str) -> None:
        """Where the model's own kernels run ("triton" | "torch": the --kernels path, see KVSettings.kernel_path):
        the routed experts' grouped GEMMs."""
        for block in self.layers:
            if block.spec.ffn != "dense":
                block.moe.kernels = path

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The global LeRoPE tables (cos, sin) [N, dR/2] of positions [N]."""
        return rope_cos_sin(rope_frequencies(self.cfg, self.lerope.alpha), positions, self.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and soft cap: h [n, D] -> logits [n, V] (fp32, or fp64 in tests)."""
        x = self.norm(h)
        z = torch.nn.functional.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        z = z.to(self.logits_dtype)
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(z / cap) if cap else z

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, segments: list[Segment], kv: LatentKV,
                logits_at: torch.Tensor | None = None, trace: ForwardTrace | None = None) -> torch.Tensor:
        """tokens [N] (segments concatenated) -> logits [N, V], or [len(logits_at), V] for those rows only.

        Every segment's earlier positions must already be in `kv` (chunked prefill / decode continue there).
        With `logits_at` and no trace, layers from `last_writer` on compute only those rows (all rows are cached
        and nothing after reads the others): in prefill, the last layers' top-k and attention run once per chunk,
        not per token. A trace observes every row, so a traced forward computes them all.
        """
        positions, seg = segment_positions(segments, self.device)
        cos, sin = self.rope(positions)
        b = AttentionBatch(positions, seg, kv, cos, sin, {}, trace)
        keep, rows = None, logits_at                  # rows: logits_at as indices into the final h
        if logits_at is not None and trace is None:
            keep, rows = torch.unique(logits_at, return_inverse=True)
        kv.begin_step(segments)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, b, keep if layer.spec.index == self.last_writer else None)
            if trace is not None and layer.spec.index in trace.tap_layers:
                trace.taps[layer.spec.index] = h
        kv.end_step()
        if trace is not None:   # per segment, as callers compare them request by request
            lengths, split = [s.length for s in segments], {}   # sharers keep their owner's very object
            trace.selections = {l: split.setdefault(id(sel), list(sel.split(lengths)))
                                for l, sel in trace.selections.items()}
        return self.head(h if rows is None else h[rows])
