"""Rank 0 of a serving parallel group (TP and/or DCP): the engine hooks that make the followers replay its steps.

`Leader` plugs into the ordinary engine (`Engine(..., hooks=Leader(...))`): before each forward it broadcasts the
step, it records every release, rollback and draft-window update (`Op`s sent with the next step), and under
tensor parallelism it runs the drafter's block forwards on every rank. When idle it sends a heartbeat every
quarter of the group timeout, so a follower's receive only times out when rank 0 is really gone; when the engine
stops it tells them to leave. A broken group (GroupError) is fatal to the engine; `diagnose` names the peer that
failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..engine.hooks import EngineFatal, EngineHooks
from ..engine.runner import ScheduledStep
from ..engine.speculative import Proposer
from ..kv.base import LatentKV
from ..model.ml4 import ML4
from .group import GroupError, RankGroup
from .sharded_kv import ShardedKV
from .replica import Op, RankInfo, RankPool, ReplayStep, StepMessage, gather_pools, gather_ranks

log = logging.getLogger("hisparse.parallel")


class Leader(EngineHooks):
    """Rank 0's side of the step protocol over `group` (every rank); `kv` is rank 0's store (its ShardedKV under
    DCP). `lockstep_drafts`: every rank runs the drafter's block forwards (tensor parallelism). `diagnose`
    (optional) says which peer failed, for the error every request in flight gets when the group breaks."""

    isolates_failures = False      # the followers ran the step too: a rerun of part of it would diverge

    def __init__(self, group: RankGroup, kv: LatentKV, lockstep_drafts: bool = False):
        self.group, self.kv, self.lockstep_drafts = group, kv, lockstep_drafts
        self.idle_s = group.timeout_s / 4
        self.ops: list[Op] = []
        self.pools: list[RankPool] = []
        self.diagnose: Callable[[], str] | None = None
        if isinstance(kv, ShardedKV):   # every prefix-cache decision is rank 0's
            kv.record = self.record

    def record(self, op: Op) -> None:
        self.ops.append(op)

    def send(self, step: ScheduledStep | None = None, stop: bool = False) -> None:
        """Broadcast the pending ops and `step` (None: a heartbeat)."""
        msg = StepMessage(self.ops, None if step is None else ReplayStep.of(step), stop)
        self.ops = []
        self.group.broadcast_object(msg, "rank 0's step" if step is not None else "rank 0's heartbeat")

    def gather(self) -> None:
        """Every rank's pool numbers after the message (all ranks call it)."""
        self.pools = gather_pools(self.group, self.kv)

    def start_up(self, model: ML4) -> list[RankInfo]:
        """The start-up exchanges `run_follower` makes on every other rank: weights and working sets, then pools."""
        ranks = gather_ranks(self.group, model, self.kv)
        self.gather()
        return ranks

    # ---- EngineHooks ----
    def proposer(self, proposer: Proposer) -> Proposer:
        return LockstepProposer(proposer, self) if self.lockstep_drafts else proposer

    def before_forward(self, step: ScheduledStep) -> None:
        self.send(step)

    def after_forward(self) -> None:
        self.gather()

    def released(self, req_id: str) -> None:
        self.record(("release", req_id))

    def rolled_back(self, req_id: str, length: int) -> None:
        self.record(("rollback", req_id, length))

    def observed(self, indices: list[int], kept: list[int]) -> None:
        self.record(("observe", list(indices), list(kept)))

    def idle(self) -> None:
        self.send()
        self.gather()

    def rank_pools(self) -> list[RankPool]:
        return self.pools

    def failed(self, err: EngineFatal) -> EngineFatal:
        why = self.diagnose() if self.diagnose is not None else ""
        return GroupError(f"{why}. {err}") if why else err

    def stopped(self) -> None:
        """Release the followers."""
        try:
            self.send(stop=True)
        except GroupError as e:   # a follower already gone: the caller's clean-up reports it
            log.warning("could not release the followers: %s", e)


class LockstepProposer:
    """Rank 0's drafter when its block forward has collectives (tensor parallelism: the drafter reads the
    vocab-parallel embedding and head): each `propose_batch` is first sent to the followers as a "propose" op, so
    every rank runs the same block forward; the followers' drafts are discarded (rank 0's reach them as the next
    step's tokens). Everything else is the drafter's own (window caches stay replicated by the observe ops)."""

    def __init__(self, inner: Proposer, leader: Leader):
        self.inner, self.leader = inner, leader

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose_batch(self, reqs: list, anchors, pos, n: int, sample):
        self.leader.record(("propose", list(reqs), anchors.tolist(), pos.tolist(), n))
        self.leader.send()                 # the followers apply the ops up to and including this propose ...
        out = self.inner.propose_batch(reqs, anchors, pos, n, sample)
        self.leader.gather()               # ... then exchange pool stats, as after every message
        return out
