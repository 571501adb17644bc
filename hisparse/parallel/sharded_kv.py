"""One DCP rank's shard of the latent store: the rows and indexer keys of the positions it owns (spec §7).

`ShardedKV` wraps an ordinary LatentKV (ResidentKV, or HiSparseKV with its own host pool and working set) and
stores token p, if this rank owns it, under its dense local index local(p). Keying by local index rather than
by global position keeps everything the inner store does per position dense: a chunk of positions maps to a
contiguous local range (HiSparse's one-contiguous-segment-per-step writes), host-pool pages fill completely
(global positions would leave R-1 of every R rows of a page empty), and the resident window holds this rank's
newest own tokens. The model passes global positions; the mapping happens here.

Prefix caching works in units of R x lcm(P, I) global tokens: each rank owns lcm(P, I) positions of every unit,
whole pages of its store, so a unit is cached or not on every rank alike. Rank 0 decides every hit and every unit
cached (`record`: the ops the followers replay with `attach_units` and `cache_units`); each rank keeps its own
rows.

Capacity and admission are reported in global tokens. Rank 0 owns the first interleave block, so its share of
any context is the largest; the scheduler runs on rank 0, and a reservation that fits rank 0 fits every rank
(equal pools).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Sequence

import torch

from ..core.batch import Segment
from ..kv.base import LatentKV, RowSource
from ..kv.scoring import Scorer
from .context import DCPContext


class ShardedKV(LatentKV):
    def __init__(self, inner: LatentKV, dcp: DCPContext):
        self.inner, self.dcp, self.sharding = inner, dcp, dcp.sharding
        self.cfg, self.device, self.dtype = inner.cfg, inner.device, inner.dtype
        self.layout, self.pages, self.page_tokens = inner.layout, inner.pages, inner.page_tokens
        self.index_keys, self.stats = inner.index_keys, inner.stats   # local-keyed
        self.reserved: dict[Hashable, int] = {}
        self.salt, self.chains, self.committed = inner.salt, {}, {}
        self.record: Callable[[tuple], None] | None = None   # rank 0: sends prefix-cache ops to the followers

    @property
    def tables(self):
        return self.inner.tables

    # ---- the batch seam: global positions in, local indices to the inner store ----
    def _owned(self, seg: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row indices, segments, local indices) of the rows whose positions this rank owns."""
        own = (self.sharding.owner(positions) == self.sharding.rank).nonzero().squeeze(1)
        return own, seg[own], self.sharding.local(positions[own])

    def write(self, layer: int, seg: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep the rows [n, r + dR] of the positions this rank owns; drop the rest."""
        own, s, local = self._owned(seg, positions)
        self.inner.write(layer, s, local, rows[own])

    def write_keys(self, layer: int, seg: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> None:
        own, s, local = self._owned(seg, positions)
        self.inner.write_keys(layer, s, local, keys[own])

    def select(self, layer: int, indexer: Scorer, q: torch.Tensor, w: torch.Tensor, seg: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Sel(t) [n, k]: this rank's exact local top-k over its own keys (key j is visible to t iff
        j < count_owned(p_t + 1); the scores are the single-rank ones bit for bit), merged across ranks."""
        sh = self.sharding
        cols, scores = self.inner.topk_over_keys(layer, indexer, q, w, seg, sh.count_owned(positions + 1),
                                                 with_scores=True)
        where = sh.global_of(cols.clamp(min=0)).masked_fill(cols < 0, -1)
        return self.dcp.merge_topk(scores, where, indexer.topk, layer)

    def local_selection(self, sel: torch.Tensor) -> torch.Tensor:
        """sel [n, k] global positions -> the inner store's local indices of those this rank owns (-1 elsewhere)."""
        sh = self.sharding
        mine = (sel >= 0) & (sh.owner(sel) == sh.rank)
        return torch.where(mine, sh.local(sel.clamp(min=0)), -1)

    def gather(self, layer: int, seg: torch.Tensor, sel: torch.Tensor) -> RowSource:
        """Rows of owned selected positions (global); positions owned elsewhere read as empty (-1)."""
        return self.inner.gather(layer, seg, self.local_selection(sel))

    def stored_rows(self, layer: int, seg: torch.Tensor, sel: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The inner store's bytes of the owned selected positions (others: -1)."""
        return self.inner.stored_rows(layer, seg, self.local_selection(sel))

    def attend(self, layer: int, q_lat: torch.Tensor, q_rope: torch.Tensor | None, seg: torch.Tensor,
               sel: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention over Sel(t) ∩ Own_r, LSE-combined across ranks (lse: this rank's partial). With
        tensor-parallel heads, over the queries of every head of the group, and this rank's heads returned."""
        q_lat, q_rope = self.dcp.gather_heads(q_lat, layer), self.dcp.gather_heads(q_rope, layer)
        olat, lse = self.inner.attend(layer, q_lat, q_rope, seg, self.local_selection(sel), scale)
        return self.dcp.combine(olat, lse, layer), lse

    def begin_step(self, segments: Sequence) -> None:
        local = []
        for seg in segments:
            a, b = self.sharding.local_range(seg.start, seg.start + seg.length)
            local.append(Segment(seg.req, a, b - a))
        self.inner.begin_step(local, [seg.length for seg in segments])   # every segment's rows query here

    def end_step(self) -> None:
        self.inner.end_step()

    def release(self, req: Hashable) -> None:
        self.reserved.pop(req, None)
        self.chains.pop(req, None)
        self.committed.pop(req, None)
        self.inner.release(req)

    # ---- prefix caching in units whose share is whole pages on every rank ----
    @property
    def prefix_unit(self) -> int:
        return self.sharding.size * math.lcm(self.page_tokens, self.sharding.interleave)

    @property
    def unit_pages(self) -> int:
        return math.lcm(self.page_tokens, self.sharding.interleave) // self.page_tokens

    def unit_page_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        m = self.unit_pages
        return keys if m == 1 else [hashlib.blake2b(k + j.to_bytes(4, "little"), digest_size=16).digest()
                                    for k in keys for j in range(m)]

    def attached(self, req: Hashable, n_tokens: int, keys: list[bytes]) -> None:
        self.inner.attached(req, self.sharding.count_owned(n_tokens), self.unit_page_keys(keys))
        if self.record is not None:
            self.record(("prefix", req, keys))

    def cache_units(self, req: Hashable, first: int, keys: list[bytes]) -> None:
        super().cache_units(req, first, keys)
        if self.record is not None:
            self.record(("cache", req, first, keys))

    def reset_prefix_cache(self) -> int:
        if self.record is not None:
            self.record(("reset_prefix_cache",))
        return self.inner.reset_prefix_cache()

    def truncate(self, req: Hashable, length: int) -> None:
        self.inner.truncate(req, self.sharding.count_owned(length))

    # ---- capacity in global tokens (this rank's store holds its share) ----
    def resident_rows(self) -> int:
        return self.inner.resident_rows()

    def residency(self, req: Hashable) -> float:
        return self.inner.residency(req)

    def token_capacity(self) -> int | None:
        cap = self.inner.token_capacity()
        return None if cap is None else self.sharding.span_of(cap)

    def tokens_unreserved(self) -> int | None:
        free = self.inner.tokens_unreserved()
        return None if free is None else self.sharding.span_of(free)

    def can_ever_admit(self, n_tokens: int) -> bool:
        return self.inner.can_ever_admit(self.sharding.most_loaded(n_tokens))

    def max_working_sets(self) -> int | None:
        return self.inner.max_working_sets()

    def reserve(self, req: Hashable, n_tokens: int) -> bool:
        """Reserve the most loaded rank's share of n_tokens here; `reserved` keeps the global count."""
        if not self.inner.reserve(req, self.sharding.most_loaded(n_tokens)):
            return False
        self.reserved[req] = max(self.reserved.get(req, 0), n_tokens)
        return True

    def usage_ratio(self) -> float:
        return self.inner.usage_ratio()
