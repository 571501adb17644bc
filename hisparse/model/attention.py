"""MLA without query LoRA, with SSMax and absorbed sparse attention over the rows LatentKV returns (§3.5-3.7).

Every layer makes one call per seam operation for the whole batch (write rows, write keys, select, attend);
no loop over requests. Where the rows live (resident, host pool + working set, DCP shards) is the LatentKV's
business: decode context parallelism is a LatentKV (`hisparse.parallel.sharded_kv.ShardedKV`) like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.batch import ForwardTrace
from ..core.config import LayerSpec, ModelConfig
from .indexer import Indexer, ssmax_gain
from ..kv.base import LatentKV
from .linear import Linear
from .norm import RMSNorm
from .rope import LeRoPE, apply_rope, rope_cos_sin, rope_frequencies


@dataclass
class AttentionBatch:
    """Per-forward state shared by every layer's attention: flat per-row tensors, no per-request lists."""
    positions: torch.Tensor                      # [N] absolute position of each row
    seg: torch.Tensor                            # [N] segment (request) of each row
    kv: LatentKV
    cos: torch.Tensor                            # [N, dR/2] from the global LeRoPE alpha
    sin: torch.Tensor
    selections: dict[int, torch.Tensor]          # indexer-owner layer -> [N, k] positions, -1 padded
    trace: ForwardTrace | None = None

    def narrow_(self, keep: torch.Tensor) -> None:
        """Keep only the query rows `keep` (ascending indices into the batch) for the layers still to run.

        Segments (and so the cached prefix each one reads) stay whole; positions, segment ids, rope tables and the
        selections already made follow the kept rows."""
        self.selections = {l: sel[keep] for l, sel in self.selections.items()}
        self.positions, self.seg, self.cos, self.sin = self.positions[keep], self.seg[keep], self.cos[keep], \
            self.sin[keep]


@dataclass
class Queries:
    """One layer's query side for the seam."""
    q_lat: torch.Tensor                          # [N, H, r] absorbed queries (SSMax gain applied)
    q_rope: torch.Tensor | None                  # [N, H, dR] (None on NoPE layers)
    index_q: torch.Tensor | None                 # [N, HI, dI] indexer queries (index owner)
    index_w: torch.Tensor | None                 # [N, HI] indexer head weights


class MLA(nn.Module):
    """One layer's attention: `layers.N.attention.*`."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        H, r = cfg.n_heads, cfg.kv_lora_rank
        self.n_heads = H   # the heads this module computes (a tensor-parallel rank holds n_heads / TP of them)
        self.q_head_dim, self.scale = cfg.q_head_dim(spec), cfg.softmax_scale(spec)
        self.wq = Linear(cfg.dim, H * self.q_head_dim, bias=False)
        if spec.kv_owner:
            self.wkv_a_with_mqa = Linear(cfg.dim, r + (cfg.qk_rope_head_dim if spec.rope else 0), bias=False)
            self.kv_a_norm = RMSNorm(r, cfg.norm_eps)
        self.wkv_b = Linear(r, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = Linear(H * cfg.v_head_dim, cfg.dim, bias=False)
        self.ssmax_scaling = nn.Parameter(torch.zeros(H, 2)) if cfg.ssmax_attention else None
        self.lerope = LeRoPE(cfg.qk_rope_head_dim) if (cfg.lerope_per_layer and spec.rope) else None
        self.indexer = Indexer(cfg, spec) if spec.index_owner else None

    def rope_tables(self, b: AttentionBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This layer's (cos, sin) [N, dR/2]: None on NoPE layers, the batch's unless the layer has its own LeRoPE.
        Block computes them once for `cache_rows` and `queries` (per-layer LeRoPE costs a table per row)."""
        if not self.spec.rope:
            return None, None
        if self.lerope is None:
            return b.cos, b.sin
        return rope_cos_sin(rope_frequencies(self.cfg, self.lerope.alpha), b.positions, b.cos.dtype)

    # A layer runs as dense projections (`cache_rows`, `queries`), the KV seam (`store`, `attend`: every call
    # that reads or writes LatentKV) and a dense output (`output`). The dense parts have the batch's static shapes;
    # CUDA graphs capture them and run the seam between them (hisparse.engine.cuda_graphs).
    def cache_rows(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What this layer caches for every row of x [N, D]: latent rows [N, r + dR] (KV owner: c = RMSNorm(a[:r]),
        k_rope = R(p) a[r:], zeros on NoPE layers) and indexer keys [N, dI] (index owner); None where it caches
        nothing."""
        rows = keys = None
        if self.spec.kv_owner:
            r = self.cfg.kv_lora_rank
            a = self.wkv_a_with_mqa(x)
            c = self.kv_a_norm(a[:, :r])
            k_rope = apply_rope(a[:, r:], cos, sin) if self.spec.rope else c.new_zeros(c.shape[0],
                                                                                      self.cfg.qk_rope_head_dim)
            rows = torch.cat((c, k_rope), dim=-1)
        if self.indexer is not None:
            keys = self.indexer.keys(x, cos, sin)
        return rows, keys

    def store(self, rows: torch.Tensor | None, keys: torch.Tensor | None, b: AttentionBatch) -> None:
        """Seam: write `cache_rows`' rows and keys for every row of the batch."""
        if rows is not None:
            b.kv.write(self.spec.index, b.seg, b.positions, rows)
        if keys is not None:
            b.kv.write_keys(self.spec.index, b.seg, b.positions, keys)

    def queries(self, x: torch.Tensor, b: AttentionBatch, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> Queries:
        """Every query row's absorbed query and (index owner) indexer query, from x [N, D]."""
        cfg, spec = self.cfg, self.spec
        H, dN = self.n_heads, cfg.qk_nope_head_dim
        q = self.wq(x).view(-1, H, self.q_head_dim)
        q_nope, q_rope = q[..., :dN], (apply_rope(q[..., dN:], cos, sin) if spec.rope else None)
        if self.ssmax_scaling is not None:
            g = ssmax_gain(self.ssmax_scaling, b.positions, x.dtype)[..., None]    # [N, H, 1]
            q_nope, q_rope = q_nope * g, (q_rope * g if q_rope is not None else None)
        q_lat = torch.einsum("thd,hdc->thc", q_nope, self.w_kvb(x.dtype, slice(0, dN)))    # [N, H, r]
        index_q = index_w = None
        if self.indexer is not None:
            index_q, index_w = self.indexer.queries(x, b.positions, cos, sin)          # [N, HI, dI], [N, HI]
        return Queries(q_lat, q_rope, index_q, index_w)

    def attend(self, q: Queries, b: AttentionBatch) -> torch.Tensor:
        """Seam: select every query row's top-k (own indexer, or the source owner's selection) and run sparse MLA
        over it: olat [N, H, r]."""
        if self.indexer is None:
            sel = b.selections[self.spec.index_source]
        else:
            sel = b.selections[self.spec.index] = b.kv.select(self.spec.index, self.indexer, q.index_q, q.index_w,
                                                              b.seg, b.positions)
        if b.trace is not None:
            b.trace.selections[self.spec.index] = sel
        olat, _ = b.kv.attend(self.spec.index, q.q_lat, q.q_rope, b.seg, sel, self.scale)
        return olat

    def forward(self, x: torch.Tensor, b: AttentionBatch, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:   # x [N, D], cos/sin [N, dR/2] -> [N, D]
        """Attention of the query rows x (after `store`: a query sees its own position's latent and key)."""
        return self.output(self.attend(self.queries(x, b, cos, sin), b))

    def output(self, olat: torch.Tensor) -> torch.Tensor:
        """olat [N, H, r] -> the layer's attention output [N, D]."""
        w_v = self.w_kvb(olat.dtype, slice(self.cfg.qk_nope_head_dim, None))           # [H, dV, r]
        o = torch.einsum("thc,hvc->thv", olat, w_v)                                     # [N, H, dV]
        return self.wo(o.flatten(1))

    def w_kvb(self, dtype: torch.dtype, part: slice) -> torch.Tensor:
        """Rows `part` of every head's wkv_b (the nope half for the absorbed query, the value half for the output):
        [H, len(part), r] in `dtype`; an FP8 wkv_b dequantises only that half."""
        return self.wkv_b.dequantized_rows(dtype, self.n_heads, part)
