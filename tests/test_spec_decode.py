"""The engine's `Speculator` step by step, with hooks that record what it tells the parallel followers: each count
of accepted drafts (0..n, enumerated) emits its tokens and rolls back exactly the rejected positions; the hooks
given are the ones called, and they pick the drafter; the context path hands the drafter only the newest `window`
kept rows (all of them without a window)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from hisparse.core.batch import Segment
from hisparse.engine.hooks import EngineHooks
from hisparse.engine.request import Request, SamplingParams
from hisparse.engine.runner import ScheduledStep, SegmentOutput
from hisparse.engine.spec_decode import Speculator
from hisparse.engine.speculative import OracleProposer, SpeculativeConfig
from hisparse.kv.resident import ResidentKV
from hisparse.model.dspark import DSparkDrafter

N, P, V = 3, 10, 16          # drafts per verify, the anchor's position, vocabulary


class Recorder(EngineHooks):
    """Hooks that log the rollbacks and context-path updates, and hand the speculator a drafter of their own."""

    def __init__(self, drafter=None):
        self.rollbacks: list[tuple[str, int]] = []
        self.observed_calls: list[tuple[list[int], list[int]]] = []
        self.drafter = drafter

    def proposer(self, proposer):
        return self.drafter or proposer

    def rolled_back(self, req_id: str, length: int) -> None:
        self.rollbacks.append((req_id, length))

    def observed(self, indices: list[int], kept: list[int]) -> None:
        self.observed_calls.append((indices, kept))


class LoggingDrafter(DSparkDrafter):
    """The real drafter, logging what its context path receives."""

    def __init__(self, model):
        super().__init__(model)
        self.log: list[tuple[list, list[int], list[int]]] = []

    def observe_batch(self, reqs, taps, positions, counts):
        self.log.append((list(reqs), positions.tolist(), list(counts)))
        super().observe_batch(reqs, taps, positions, counts)


def verify_step(drafts: list[int], accepted: int) -> tuple[ScheduledStep, list[SegmentOutput]]:
    """A greedy verify [anchor, d_1..d_N] at P..P+N whose target logits accept the first `accepted` drafts, then
    prefer token 0 (a correction when a draft is rejected, the bonus token otherwise)."""
    req = Request("r", [1] * P, SamplingParams(temperature=0.0))
    step = ScheduledStep()
    step.add(req, Segment(req.id, P, N + 1), N)
    step.drafts[0] = drafts
    logits = torch.zeros(N + 1, V)
    for i, d in enumerate(drafts[:accepted]):
        logits[i, d] = 1.0
    logits[accepted, 0] = 2.0
    return step, [SegmentOutput(0, req, step.segments[0], logits, {})]


@pytest.mark.parametrize("accepted", range(N + 1))
def test_accept_emits_and_rolls_back_exactly_the_rejected_positions(accepted: int) -> None:
    hooks = Recorder()
    model = tiny_model(0)
    spec = Speculator(SpeculativeConfig("dspark", N, "greedy"), OracleProposer([]),
                      ResidentKV(model.cfg, None, dtype=model.dtype), hooks=hooks)
    drafts = [5, 6, 7]
    step, outs = verify_step(drafts, accepted)
    assert spec.accept(step, outs) == [drafts[:accepted] + [0]]
    # kept: the anchor and the accepted drafts (P .. P + accepted); a full acceptance keeps every row
    assert hooks.rollbacks == ([("r", P + accepted + 1)] if accepted < N else [])
    assert spec.stats.steps == 1 and spec.stats.accepted == accepted and spec.stats.proposed == N


def test_the_hooks_given_are_called_and_pick_the_drafter() -> None:
    chosen = OracleProposer([])
    hooks = Recorder(chosen)
    model = tiny_model(0)
    spec = Speculator(SpeculativeConfig("dspark", N, "greedy"), OracleProposer([1]),
                      ResidentKV(model.cfg, None, dtype=model.dtype), hooks=hooks)
    assert spec.proposer is chosen and spec.hooks is hooks
    spec.rollback("r", 4)
    assert hooks.rollbacks == [("r", 4)]
    plain = Speculator(SpeculativeConfig("dspark", N, "greedy"), chosen, ResidentKV(model.cfg, None,
                                                                                   dtype=model.dtype))
    assert type(plain.hooks) is EngineHooks and plain.proposer is chosen


@pytest.mark.parametrize("window, first", [(None, 20), (3, 24), (7, 20), (9, 20)])
def test_the_context_path_gets_the_newest_window_rows(window: int | None, first: int) -> None:
    """Two segments (a 7-row prompt chunk at 20 and a 4-row verify at 40 keeping 2): with window w each gives the
    drafter its newest min(w, kept) rows; `first`: the first position of the chunk's rows it gets."""
    model = tiny_model(0)
    drafter = LoggingDrafter(model)
    hooks = Recorder()
    spec = Speculator(SpeculativeConfig("dspark", N, "greedy"), drafter,
                      ResidentKV(model.cfg, None, dtype=model.dtype), window=window, hooks=hooks)
    reqs = [Request(name, [1] * 4, SamplingParams()) for name in ("a", "b")]
    segs = [Segment("a", 20, 7), Segment("b", 40, 4)]
    outs = [SegmentOutput(i, r, s, None, {l: torch.randn(s.length, model.cfg.dim, dtype=model.dtype)
                                          for l in drafter.tap_layers})
            for i, (r, s) in enumerate(zip(reqs, segs))]
    spec.observe(outs, [7, 2])
    assert drafter.log == [(["a", "b"], list(range(first, 27)) + [40, 41], [27 - first, 2])]
    assert hooks.observed_calls == [([0, 1], [7, 2])]
