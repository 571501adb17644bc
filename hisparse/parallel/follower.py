"""A follower rank of a serving DCP group: replays rank 0's steps on its own shard of the KV.

It owns a model replica, its ShardedKV (its own host pool and working set under HiSparse) and, with speculative
decoding, its own DSpark draft window cache, kept identical to rank 0's by the same observe / rollback / release
ops on the same (replicated) hidden states. It never schedules or samples, and drafts only under tensor
parallelism, where it runs rank 0's block forwards in lockstep ("propose" ops) and discards its drafts.
"""

from __future__ import annotations

import torch

from ..engine.runner import ModelRunner, SegmentOutput
from ..engine.spec_decode import Speculator
from .group import RankGroup
from .replica import Op, StepMessage, gather_pools


class Follower:
    """runner: this rank's model and ShardedKV (taps on when speculating); speculator: its draft window (None
    without speculative decoding; it only observes, rolls back and releases, it never proposes)."""

    def __init__(self, group: RankGroup, runner: ModelRunner, speculator: Speculator | None = None):
        self.group, self.runner, self.speculator = group, runner, speculator
        self.last: dict[int, SegmentOutput] = {}    # the last forward's outputs by segment index (for "observe")

    def run(self) -> None:
        """Replay messages (their ops first, then their step) until rank 0 says stop; GroupError when rank 0 is
        gone or hung, or a collective fails."""
        while True:
            msg: StepMessage = self.group.broadcast_object(None, "rank 0's next step or heartbeat")
            for op in msg.ops:
                self.apply(op)
            if msg.stop:
                return
            if msg.step is not None:    # a failure here ends this rank (no rerun: rank 0 ran the step as a whole)
                self.last = {o.index: o for o in self.runner.forward(msg.step, list(range(len(msg.step.reqs))))}
            gather_pools(self.group, self.runner.kv)

    def apply(self, op: Op) -> None:
        kind, *arg = op
        if kind == "release":
            self.runner.kv.release(arg[0])
            if self.speculator is not None:
                self.speculator.release(arg[0])
        elif kind == "rollback":
            self.speculator.rollback(*arg)
        elif kind == "observe":
            indices, kept = arg
            self.speculator.observe([self.last[i] for i in indices], kept)
        elif kind == "prefix":      # rank 0 started the request from cached units
            self.runner.kv.attach_units(*arg)
        elif kind == "cache":       # rank 0 cached units of the request
            self.runner.kv.cache_units(*arg)
        elif kind == "reset_prefix_cache":
            self.runner.kv.reset_prefix_cache()
        elif kind == "propose":   # rank 0's block forward, run here for its collectives; the drafts are rank 0's
            reqs, anchors, pos, n = arg
            self.speculator.proposer.propose_batch(reqs, torch.tensor(anchors), torch.tensor(pos), n,
                                                   lambda z: (z.argmax(-1), None))
        else:
            raise ValueError(f"DCP rank {self.group.rank}: unknown op {kind!r} from rank 0")
