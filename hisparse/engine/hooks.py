"""The engine's extension points: what else runs when the engine steps, drafts, releases, idles, fails or stops.

One process needs none of them (`EngineHooks` does nothing). Rank 0 of a parallel group plugs in
`hisparse.parallel.leader.Leader`: it sends every step to the follower ranks before the forward, records every
release, rollback and drafter update for them, sends heartbeats when idle and names the rank that failed.
The engine, its runner and its speculator call the hooks; nothing subclasses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runner import ScheduledStep
    from .speculative import Proposer


class EngineFatal(RuntimeError):
    """An error no request isolation can fix (a parallel group whose peer died or hung): every request in flight
    fails with it and the engine stops."""


class EngineHooks:
    """Defaults: nothing happens. `idle_s`: after this long without work the engine calls `idle` (None: it
    just waits for work). `isolates_failures`: a failed forward is rolled back and rerun request by request; a
    parallel group cannot do that (its ranks would run different collectives), so there a failed forward is
    fatal."""
    idle_s: float | None = None
    isolates_failures: bool = True

    def proposer(self, proposer: Proposer) -> Proposer:
        """The drafter the speculator calls (rank 0 under tensor parallelism: one that runs its block forwards on
        every rank)."""
        return proposer

    def before_forward(self, step: ScheduledStep) -> None:
        """A step is about to run on the model (rank 0: send it to the followers)."""

    def after_forward(self) -> None:
        """The step's forward ran (rank 0: every rank's pool report)."""

    def released(self, req_id: str) -> None:
        """A request's KV was freed: it finished, failed, was aborted or preempted."""

    def rolled_back(self, req_id: str, length: int) -> None:
        """A request's positions >= length were forgotten (rejected drafts)."""

    def observed(self, indices: list[int], kept: list[int]) -> None:
        """The drafter's context path ran for the first kept[i] rows of the step's segments `indices`."""

    def idle(self) -> None:
        """idle_s passed without work (rank 0: a heartbeat)."""

    def rank_pools(self) -> list[Any]:
        """Each rank's host pool report (`hisparse.parallel.replica.RankPool`); [] in one process."""
        return []

    def failed(self, err: EngineFatal) -> EngineFatal:
        """The error every request gets when the engine stops on `err` (rank 0: naming the rank that failed)."""
        return err

    def stopped(self) -> None:
        """The engine thread stopped cleanly (rank 0: tell the followers to leave)."""
