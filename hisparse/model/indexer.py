"""Lightning indexer (spec §3.6): projects each row's indexer queries, head weights and keys; the KV stores score
them (hisparse.kv.scoring: exact top-k, score descending, ties by position ascending)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core.config import ModelConfig, LayerSpec
from ..kv.kernels import indexer_topk
from ..kv.scoring import SCORE_BLOCK_ELEMS, fused_keys, index_scores, score_dtype, select_topk
from .linear import Linear
from .norm import LayerNorm
from .rope import apply_rope


def ssmax_gain(scaling: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SSMax query gain g_h(p) = s_h * ln(p + 1) + b_h (spec §3.4): [T, H]."""
    logp = torch.log1p(positions.to(torch.float64)).to(dtype)
    sc = scaling.to(dtype)
    return logp[:, None] * sc[None, :, 0] + sc[None, :, 1]


class Indexer(nn.Module):
    """Per-layer lightning indexer; present only on indexer-owner layers."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim if spec.rope else 0
        self.interleave = cfg.indexer_rope_interleave
        self.q_norm = LayerNorm(cfg.dim)
        self.wq_b = Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.dim, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim)
        self.weights_proj = Linear(cfg.dim, self.n_heads, bias=False)
        self.ssmax_scaling = nn.Parameter(torch.zeros(self.n_heads, 2)) if cfg.ssmax_indexer else None

    def keys(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """x [N, D] (attention_norm output) -> K [N, dI], the cached keys."""
        k = self.k_norm(self.wk(x))
        return self.rope(k, cos, sin)

    def queries(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] (attention_norm output) -> Q [N, HI, dI], head weights w [N, HI]."""
        q = self.rope(self.wq_b(self.q_norm(x)).view(-1, self.n_heads, self.head_dim), cos, sin)
        if self.ssmax_scaling is not None:
            q = q * ssmax_gain(self.ssmax_scaling, positions, q.dtype)[..., None]
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).to(x.dtype)
        return q, w

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> Q [N, HI, dI], K [N, dI], w [N, HI]: queries and keys of the same rows (training)."""
        q, w = self.queries(x, positions, cos, sin)
        return q, self.keys(x, cos, sin), w

    def rope(self, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """RoPE on the first rope_dim dims of v [..., dI] (RoPE layers; identity on NoPE layers)."""
        if not self.rope_dim:
            return v
        r = self.rope_dim
        return torch.cat((apply_rope(v[..., :r], cos, sin, self.interleave), v[..., r:]), dim=-1)

    def head_weights(self, w: torch.Tensor) -> torch.Tensor:
        """w [T, HI] -> w / (sqrt(dI) sqrt(HI)) in the score dtype (w converted first, exactly): relu(x)/c ==
        relu(x/c) for c > 0, so both scales go here."""
        return w.to(score_dtype(w.dtype)) / (math.sqrt(self.head_dim) * math.sqrt(self.n_heads))

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Top-k over keys [S, dI] (positions 0..S-1) for queries q [T, HI, dI] at `positions` -> [T, min(k,S)].

        Large CPU inputs go to the fused kernel (scores never stored), the rest to index_scores + select_topk on
        blocks of queries: both give identical selections (scores in score_dtype(q.dtype))."""
        sd = score_dtype(q.dtype)
        q, wr = q.to(sd), self.head_weights(w).to(sd)
        S = keys.shape[0]
        if q.shape[0] == 0:      # a segment with no query rows here (see AttentionBatch.narrow_)
            return torch.empty(0, min(self.topk, S), dtype=torch.long, device=q.device)
        fused = fused_keys(q, wr, keys, q.shape[0] * S)
        if fused is not None:
            return indexer_topk.fused_topk(q, wr, fused, (positions + 1).clamp(0, S), self.topk)[0]
        keys = keys.to(sd)
        rows = max(1, SCORE_BLOCK_ELEMS // max(1, self.n_heads * S))
        out = []
        for i in range(0, q.shape[0], rows):   # blocks of queries bound the score memory
            out.append(select_topk(index_scores(q[i:i + rows], wr[i:i + rows], keys, positions[i:i + rows]),
                                   self.topk))
        return torch.cat(out)
