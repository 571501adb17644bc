"""Rank 0 of a serving parallel group (TP and/or DCP): the engine whose every forward the followers replay.

`DCPEngine` is the ordinary engine with three hooks: its runner broadcasts each step before running it, its
speculator records every rollback and draft-window update, and every finished request records its release
(`Leader` collects these `Op`s and sends them with the next step). When idle it sends a heartbeat every quarter
of the group timeout, so a follower's receive only times out when rank 0 is really gone; `stop` tells them to
leave. A broken group (DCPError) is fatal to the engine (see Engine); `diagnose` names the peer that failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..engine.cuda_graphs import DecodeGraphs
from ..engine.engine import Engine
from ..engine.request import Request, TokenLogprobs
from ..engine.runner import ModelRunner, ScheduledStep, SegmentOutput, StepResult
from ..engine.spec_decode import Speculator
from ..engine.speculative import Proposer, SpeculativeConfig
from ..kv.base import LatentKV
from ..model.ml4 import ML4
from .group import DCPError, DCPGroup
from .replica import Op, RankInfo, RankPool, ReplayStep, StepMessage, gather_pools, gather_ranks

log = logging.getLogger("hisparse.parallel")


class Leader:
    """Rank 0's side of the step protocol: the ops since the last message, and the last RankPool report."""

    def __init__(self, group: DCPGroup, kv: LatentKV):
        self.group, self.kv = group, kv
        self.ops: list[Op] = []
        self.pools: list[RankPool] = []

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


class LeaderRunner(ModelRunner):
    def __init__(self, leader: Leader, model: ML4, kv: LatentKV, tap_layers: tuple[int, ...],
                 graphs: DecodeGraphs | None = None):
        super().__init__(model, kv, tap_layers, graphs)
        self.leader = leader

    def execute(self, step: ScheduledStep) -> StepResult:
        self.leader.send(step)
        result = super().execute(step)
        self.leader.gather()
        return result


class LeaderSpeculator(Speculator):
    def __init__(self, leader: Leader, config: SpeculativeConfig, proposer: Proposer, kv: LatentKV,
                 window: int | None):
        super().__init__(config, proposer, kv, window)
        self.leader = leader

    def rollback(self, req_id: str, length: int) -> None:
        self.leader.record(("rollback", req_id, length))
        super().rollback(req_id, length)

    def observe(self, outs: list[SegmentOutput], kept: list[int]) -> None:
        self.leader.record(("observe", [o.index for o in outs], list(kept)))
        super().observe(outs, kept)


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


class DCPEngine(Engine):
    """The engine on rank 0 of a parallel group `group` (every rank); `kv` is rank 0's store (its ShardedKV under
    DCP; other arguments: Engine's). Idle, it sends a heartbeat every quarter of the group timeout. `diagnose`
    (optional) says which peer failed, for the error every request in flight gets when the group breaks.
    `lockstep_drafts`: every rank runs the drafter's block forwards (tensor parallelism)."""

    def __init__(self, model: ML4, kv: LatentKV, group: DCPGroup, *args, lockstep_drafts: bool = False, **kwargs):
        self.leader = Leader(group, kv)
        self.lockstep_drafts = lockstep_drafts
        self.idle_s = group.timeout_s / 4
        self.diagnose: Callable[[], str] | None = None
        super().__init__(model, kv, *args, **kwargs)

    def make_speculator(self, config: SpeculativeConfig, proposer: Proposer, kv: LatentKV,
                        window: int | None) -> Speculator:
        if self.lockstep_drafts:
            proposer = LockstepProposer(proposer, self.leader)
        return LeaderSpeculator(self.leader, config, proposer, kv, window)

    def make_runner(self, model: ML4, kv: LatentKV, tap_layers: tuple[int, ...]) -> ModelRunner:
        return LeaderRunner(self.leader, model, kv, tap_layers, self.graphs)

    def _preempted(self, req: Request) -> None:
        self.leader.record(("release", req.id))
        super()._preempted(req)

    def _finish(self, req: Request, reason: str, new: list[int] | None = None, delta: str = "",
                error: str | None = None, **logprobs: list[TokenLogprobs] | None) -> None:
        self.leader.record(("release", req.id))
        super()._finish(req, reason, new, delta, error, **logprobs)

    def _die(self, err: DCPError) -> None:
        why = self.diagnose() if self.diagnose is not None else ""
        super()._die(DCPError(f"{why}. {err}") if why else err)

    def start_up(self, model: ML4) -> list[RankInfo]:
        """The start-up exchanges `run_follower` makes on every other rank: weights and working sets, then pools."""
        ranks = gather_ranks(self.leader.group, model, self.leader.kv)
        self.leader.gather()
        return ranks

    def idle(self) -> None:
        self.leader.send()
        self.leader.gather()

    def rank_pools(self) -> list[RankPool]:
        return self.leader.pools

    def stop(self) -> None:
        """Stop the engine thread, then release the followers (unless the group already failed)."""
        if self._stopping:
            return
        super().stop()
        if self.fatal is None:
            try:
                self.leader.send(stop=True)
            except DCPError as e:   # a follower already gone: the caller's clean-up reports it
                log.warning("could not release the DCP followers: %s", e)
