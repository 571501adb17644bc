"""MLA without query LoRA, with SSMax and absorbed sparse attention over the rows LatentKV returns (§3.5-3.7)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import nn

from .batch import ForwardTrace, Segment
from .config import LayerSpec, ModelConfig
from .indexer import Indexer, ssmax_gain
from .kv import LatentKV
from .norm import RMSNorm
from .rope import LeRoPE, apply_rope, rope_cos_sin, rope_frequencies

if TYPE_CHECKING:
    from ..dcp.context import DCPContext


@dataclass
class AttentionBatch:
    """Per-forward state shared by every layer's attention."""
    segments: list[Segment]
    slices: list[slice]
    positions: torch.Tensor                      # [N]
    kv: LatentKV
    cos: torch.Tensor                            # [N, dR/2] from the global LeRoPE alpha
    sin: torch.Tensor
    selections: dict[int, list[torch.Tensor]]    # indexer-owner layer -> per segment [T, k]
    trace: ForwardTrace | None = None

    @property
    def dcp(self) -> "DCPContext | None":
        """The decode-context-parallel hook of this rank (spec §7), carried by its sharded KV; None: one rank."""
        return self.kv.dcp

    def narrow_(self, keep: torch.Tensor) -> None:
        """Keep only the query rows `keep` (ascending indices into the batch) for the layers still to run.

        Segments (and so the cached prefix each one reads) stay whole; positions, rope tables, row slices and the
        selections already made follow the kept rows."""
        bounds = torch.tensor([sl.stop for sl in self.slices], device=keep.device)
        counts = torch.bincount(torch.bucketize(keep, bounds, right=True), minlength=len(self.slices)).tolist()
        firsts = list(accumulate(counts, initial=0))[:-1]
        local = [keep[f:f + n] - sl.start for f, n, sl in zip(firsts, counts, self.slices)]
        self.selections = {l: [sel[i] for sel, i in zip(sels, local)] for l, sels in self.selections.items()}
        self.slices = [slice(f, f + n) for f, n in zip(firsts, counts)]
        self.positions, self.cos, self.sin = self.positions[keep], self.cos[keep], self.sin[keep]


def sparse_mla(q_lat: torch.Tensor, q_rope: torch.Tensor | None, rows: torch.Tensor, valid: torch.Tensor,
               scale: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA over each query's own selected rows.

    q_lat [T, H, r] (= W_UK^T qN), q_rope [T, H, dR] or None (NoPE), rows [T, k, r + dR], valid [T, k].
    Returns olat [T, H, r] = sum_s P c[s] and lse [T, H] (-inf where a query has no valid row: output 0).
    """
    c = rows[..., :rank]
    logits = torch.einsum("thc,tkc->thk", q_lat, c)
    if q_rope is not None:
        logits = logits + torch.einsum("thr,tkr->thk", q_rope, rows[..., rank:])
    logits = (logits * scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)                                      # [T, H]
    probs = torch.exp(logits - lse.nan_to_num(neginf=0.0)[..., None])          # empty rows -> all zeros
    return torch.einsum("thk,tkc->thc", probs, c), lse


class MLA(nn.Module):
    """One layer's attention: `layers.N.attention.*`."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        H, r = cfg.n_heads, cfg.kv_lora_rank
        self.q_head_dim, self.scale = cfg.q_head_dim(spec), cfg.softmax_scale(spec)
        self.wq = nn.Linear(cfg.dim, H * self.q_head_dim, bias=False)
        if spec.kv_owner:
            self.wkv_a_with_mqa = nn.Linear(cfg.dim, r + (cfg.qk_rope_head_dim if spec.rope else 0), bias=False)
            self.kv_a_norm = RMSNorm(r, cfg.norm_eps)
        self.wkv_b = nn.Linear(r, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(H * cfg.v_head_dim, cfg.dim, bias=False)
        self.ssmax_scaling = nn.Parameter(torch.zeros(H, 2)) if cfg.ssmax_attention else None
        self.lerope = LeRoPE(cfg.qk_rope_head_dim) if (cfg.lerope_per_layer and spec.rope) else None
        self.indexer = Indexer(cfg, spec) if spec.index_owner else None

    def rope_tables(self, b: AttentionBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This layer's (cos, sin) [N, dR/2]: None on NoPE layers, the batch's unless the layer has its own LeRoPE.
        Block computes them once for `write` and `forward` (per-layer LeRoPE costs a table per row)."""
        if not self.spec.rope:
            return None, None
        if self.lerope is None:
            return b.cos, b.sin
        return rope_cos_sin(rope_frequencies(self.cfg, self.lerope.alpha), b.positions, b.cos.dtype)

    def write(self, x: torch.Tensor, b: AttentionBatch, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
        """Cache what this layer contributes for every row of x [N, D]: latents (KV owner), indexer keys (owner)."""
        if self.spec.kv_owner:
            self.write_latents(x, b, cos, sin)
        if self.indexer is not None:
            k = self.indexer.keys(x, cos, sin)                                       # [N, dI]
            if b.dcp is not None:    # each rank stores the keys of the positions it owns
                b.dcp.write_keys(k, b, self.spec.index)
            else:
                for seg, sl in zip(b.segments, b.slices):
                    b.kv.index_cache.write(self.spec.index, seg.req, b.positions[sl], k[sl])

    def forward(self, x: torch.Tensor, b: AttentionBatch, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:   # x [N, D], cos/sin [N, dR/2] -> [N, D]
        """Attention of the query rows x (after `write`: a query sees its own position's latent and key)."""
        cfg, spec = self.cfg, self.spec
        H, dN, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self.wq(x).view(-1, H, self.q_head_dim)
        q_nope, q_rope = q[..., :dN], (apply_rope(q[..., dN:], cos, sin) if spec.rope else None)
        if self.ssmax_scaling is not None:
            g = ssmax_gain(self.ssmax_scaling, b.positions, x.dtype)[..., None]    # [N, H, 1]
            q_nope, q_rope = q_nope * g, (q_rope * g if q_rope is not None else None)
        selections = self.select(x, b, cos, sin)
        w_kvb = self.wkv_b.weight.view(H, dN + cfg.v_head_dim, r)
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kvb[:, :dN])                 # [N, H, r]
        if b.dcp is not None:    # partial attention over this rank's rows, LSE-combined across ranks
            olat = b.dcp.attend(q_lat, q_rope, selections, b, spec.index, self.scale)
        else:
            olat = torch.empty_like(q_lat)
            for seg, sl, sel in zip(b.segments, b.slices, selections):
                if sl.start == sl.stop:
                    continue
                uniq, inv = torch.unique(sel.clamp(min=0), return_inverse=True)
                rows = b.kv.gather(spec.index, seg.req, uniq)[inv]                   # [T, k, r + dR]
                olat[sl], _ = sparse_mla(q_lat[sl], q_rope[sl] if q_rope is not None else None, rows, sel >= 0,
                                         self.scale, r)
        o = torch.einsum("thc,hvc->thv", olat, w_kvb[:, dN:])                        # [N, H, dV]
        return self.wo(o.flatten(1))

    def write_latents(self, x: torch.Tensor, b: AttentionBatch, cos: torch.Tensor | None,
                      sin: torch.Tensor | None) -> None:
        """KV owner: c = RMSNorm(a[:r]), k_rope = R(p) a[r:] (zeros on NoPE layers) -> LatentKV."""
        r = self.cfg.kv_lora_rank
        a = self.wkv_a_with_mqa(x)
        c = self.kv_a_norm(a[:, :r])
        k_rope = apply_rope(a[:, r:], cos, sin) if self.spec.rope else c.new_zeros(c.shape[0],
                                                                                  self.cfg.qk_rope_head_dim)
        rows = torch.cat((c, k_rope), dim=-1)
        for seg, sl in zip(b.segments, b.slices):
            b.kv.write(self.spec.index, seg.req, b.positions[sl], rows[sl])

    def select(self, x: torch.Tensor, b: AttentionBatch, cos: torch.Tensor | None,
               sin: torch.Tensor | None) -> list[torch.Tensor]:
        """Top-k positions per segment [T, k]: own indexer, or the source owner's selection (sharer)."""
        if self.indexer is None:
            sels = b.selections[self.spec.index_source]
        else:
            q, w = self.indexer.queries(x, b.positions, cos, sin)
            if b.dcp is not None:    # own keys only; exact global merge of every rank's candidates
                sels = b.dcp.select(self.indexer, q, w, b, self.spec.index)
            else:
                sels = []
                for seg, sl in zip(b.segments, b.slices):
                    keys = b.kv.index_cache.prefix(self.spec.index, seg.req, seg.start + seg.length)
                    sels.append(self.indexer.select(q[sl], w[sl], keys, b.positions[sl]))
            b.selections[self.spec.index] = sels
        if b.trace is not None:
            b.trace.selections[self.spec.index] = sels
        return sels
