"""What rank 0 of a serving DCP group sends its followers, and what every rank reports back.

Only rank 0 schedules, drafts and samples. Before each forward it broadcasts a `StepMessage`: the state changes
since the last message that the followers must mirror (`Op`s: a finished request's release, a speculative
rollback, a draft-window update from the last forward) and the step itself as a `ReplayStep` (segments, their
token ids, drafts included, and the rows that need logits). Token ids always come from rank 0, so a follower
cannot drift onto other tokens. After every message all ranks all-gather `RankPool` numbers about their own
stores (per-rank metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import accumulate

import torch
from torch import nn

from ..engine.runner import ScheduledStep
from ..kv.base import KVStats, LatentKV
from .group import RankGroup
from .sharded_kv import ShardedKV

# ("release", req_id)                 the request finished: free its KV and draft window
# ("rollback", req_id, length)         rejected drafts: forget positions >= length in the KV and draft window
# ("observe", indices, kept)           draft-window update from the first kept[i] rows of the last forward's
#                                      segment indices[i]
# ("prefix", req_id, keys)             the request starts from the cached units `keys` (prefix caching)
# ("cache", req_id, first, keys)       units first, first + 1, ... of the request are cached under `keys`
# ("reset_prefix_cache",)              drop every cached unit
# ("propose", reqs, anchors, pos, n)   run the drafter's block forward as rank 0 does (tensor parallelism: it
#                                      has collectives); the drafts are rank 0's
Op = tuple


@dataclass(frozen=True)
class RequestRef:
    """A request as followers know it: its id (the key of its KV and draft window)."""
    id: str


@dataclass
class ReplayStep(ScheduledStep):
    """Rank 0's step as followers run it: the token ids and the rows that need logits are given. The rows must be
    rank 0's: from the model's last cache writer on only they are computed, collectives included."""
    tokens: list[list[int]] = field(default_factory=list)     # per segment: its token ids, drafts included
    rows: list[int] = field(default_factory=list)             # per segment: rank 0's logit_rows()

    @classmethod
    def of(cls, step: ScheduledStep) -> "ReplayStep":
        ids = step.token_ids()
        ends = list(accumulate(s.length for s in step.segments))
        n = len(step.reqs)
        return cls([RequestRef(r.id) for r in step.reqs], list(step.segments), list(step.num_drafts),
                   [[] for _ in range(n)], [None] * n, [ids[e - s.length:e] for s, e in zip(step.segments, ends)],
                   step.logit_rows())

    def token_ids(self) -> list[int]:
        return [t for seg in self.tokens for t in seg]

    def logit_rows(self) -> list[int]:
        return list(self.rows)

    def sample_rows(self) -> list[int]:
        return list(self.rows)   # followers read no logits: the split only has to match logit_rows

    def only(self, i: int) -> "ReplayStep":
        return ReplayStep([self.reqs[i]], [self.segments[i]], [self.num_drafts[i]], [[]], [None], [self.tokens[i]],
                          [self.rows[i]])


@dataclass
class StepMessage:
    ops: list[Op]
    step: ReplayStep | None = None   # None: only the ops (rank 0 is idle: a heartbeat)
    stop: bool = False               # the server is shutting down: leave the group


@dataclass
class RankPool:
    """One rank's latent store: its host pool (0 tokens when the store has none) and cache counters."""
    capacity_tokens: int
    used_tokens: int           # token slots of pages in use (held by requests or kept by the prefix cache)
    cached_tokens: int         # token slots of pages the prefix cache keeps
    stats: KVStats

    @property
    def usage_ratio(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0


STAT_FIELDS = tuple(f.name for f in fields(KVStats))


def own_store(kv: LatentKV) -> LatentKV:
    """The store this rank holds itself (a ShardedKV's inner store)."""
    return kv.inner if isinstance(kv, ShardedKV) else kv


def gather_pools(group: RankGroup, kv: LatentKV) -> list[RankPool]:
    """Every rank's RankPool (a collective: all ranks call it). kv: this rank's store (ShardedKV under DCP)."""
    pool = getattr(own_store(kv), "pool", None)
    mine = ([pool.token_capacity, pool.pages_used * pool.page_tokens, kv.cached_pages() * pool.page_tokens]
            if pool is not None else [0, 0, 0])
    mine += [getattr(kv.stats, k) for k in STAT_FIELDS]
    every = group.all_gather(torch.tensor([mine], dtype=torch.float64, device=group.device),
                             "per-rank pool stats")                                                  # [R, 1, n]
    return [RankPool(int(r[0]), int(r[1]), int(r[2]), KVStats(**{k: int(v) for k, v in zip(STAT_FIELDS, r[3:].tolist())}))
            for r in every[:, 0].cpu()]


@dataclass
class RankInfo:
    """What a rank holds on its device, exchanged once at startup."""
    weight_bytes: int
    working_set_bytes: int    # per request: HiSparse's hot buffer + resident window rows and their metadata


def gather_ranks(group: RankGroup, model: nn.Module, kv: LatentKV) -> list[RankInfo]:
    """Every rank's RankInfo (a collective: all ranks call it, once, after joining)."""
    store = own_store(kv)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    every = group.all_gather(torch.tensor([[weights, store.working_set_bytes()]], dtype=torch.float64,
                                          device=group.device),
                             "per-rank weight and working-set bytes")
    return [RankInfo(int(w), int(s)) for w, s in every[:, 0].cpu().tolist()]
