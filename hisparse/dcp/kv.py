"""One DCP rank's shard of the latent store: the rows and indexer keys of the positions it owns (spec §7).

`ShardedKV` wraps an ordinary LatentKV (ResidentKV, or HiSparseKV with its own host pool and working set) and
stores token p, if this rank owns it, under its dense local index local(p). Keying by local index rather than
by global position keeps everything the inner store does per position dense: a chunk of positions maps to a
contiguous local range (HiSparse's one-contiguous-segment-per-step writes), host-pool pages fill completely
(global positions would leave R-1 of every R rows of a page empty), and the resident window holds this rank's
newest own tokens. The model passes global positions; the mapping happens here.

Capacity and admission are reported in global tokens. Rank 0 owns the first interleave block, so its share of
any context is the largest; the scheduler runs on rank 0, and a reservation that fits rank 0 fits every rank
(equal pools).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..model.batch import Segment
from ..model.kv import LatentKV
from .context import DCPContext


class ShardedKV(LatentKV):
    def __init__(self, inner: LatentKV, dcp: DCPContext):
        super().__init__(inner.cfg, None, inner.device, inner.dtype)
        self.inner, self.dcp, self.sharding = inner, dcp, dcp.sharding
        self.layout, self.index_cache, self.stats = inner.layout, inner.index_cache, inner.stats   # local-keyed
        self.page_tokens = inner.page_tokens

    # ---- rows: global positions in, local indices to the inner store ----
    def write(self, layer: int, req: Hashable, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep the rows [T, r + dR] of the positions [T] this rank owns; drop the rest."""
        own = self.sharding.owner(positions) == self.sharding.rank
        if bool(own.any()):
            self.inner.write(layer, req, self.sharding.local(positions[own]), rows[own])

    def gather(self, layer: int, req: Hashable, positions: torch.Tensor) -> torch.Tensor:
        """Rows [n, r + dR] of owned positions [n] (a position owned by another rank is an error)."""
        sh = self.sharding
        if not bool((sh.owner(positions) == sh.rank).all()):
            raise ValueError(f"DCP rank {sh.rank}: layer {layer} gathered positions this rank does not own")
        return self.inner.gather(layer, req, sh.local(positions))

    def begin_step(self, segments: list) -> None:
        local = []
        for seg in segments:
            a, b = self.sharding.local_range(seg.start, seg.start + seg.length)
            local.append(Segment(seg.req, a, b - a))
        self.inner.begin_step(local)

    def end_step(self) -> None:
        self.inner.end_step()

    def release(self, req: Hashable) -> None:
        self.reserved.pop(req, None)
        self.inner.release(req)

    def truncate(self, req: Hashable, length: int) -> None:
        self.inner.truncate(req, self.sharding.count_owned(length))

    # ---- capacity in global tokens (this rank's store holds its share) ----
    def token_capacity(self) -> int | None:
        cap = self.inner.token_capacity()
        return None if cap is None else self.sharding.span_of(cap)

    def tokens_unreserved(self) -> int | None:
        free = self.inner.tokens_unreserved()
        return None if free is None else self.sharding.span_of(free)

    def can_ever_admit(self, n_tokens: int) -> bool:
        return self.inner.can_ever_admit(self.sharding.most_loaded(n_tokens))

    def reserve(self, req: Hashable, n_tokens: int) -> bool:
        """Reserve the most loaded rank's share of n_tokens here; `reserved` keeps the global count."""
        if not self.inner.reserve(req, self.sharding.most_loaded(n_tokens)):
            return False
        self.reserved[req] = max(self.reserved.get(req, 0), n_tokens)
        return True

    def usage_ratio(self) -> float:
        return self.inner.usage_ratio()
