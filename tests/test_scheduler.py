"""The scheduler's settings, defaults and limits: settings checked once and immutable after, a request's
reservation (tokens plus drafts, none by default), the length limits at their boundaries, and what preemption
leaves for the recompute."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_model
from hisparse.engine.request import Request, RequestError, SamplingParams, Status
from hisparse.engine.scheduler import Scheduler, SchedulerConfig
from hisparse.kv.resident import ResidentKV


def test_settings_cannot_change_after_their_check() -> None:
    """SchedulerConfig is validated once, at construction; assigning a field afterwards would skip the check."""
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_batched_tokens = 1          # type: ignore[misc]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=1)


@pytest.mark.parametrize("drafts", [None, 0, 3])
def test_a_request_reserves_its_tokens_and_drafts_within_its_length(seed: int, drafts: int | None) -> None:
    """needed() = known tokens + drafts (none unless the scheduler is given some), never past max_len."""
    model = tiny_model(seed, sharp=False)
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8)
    kv = ResidentKV(model.cfg, "fp8_ds_mla", page_tokens=16)
    sched = Scheduler(cfg, kv) if drafts is None else Scheduler(cfg, kv, drafts)
    req = Request("r", list(range(1, 11)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    n = drafts or 0
    assert sched.needed(req) == 10 + n
    req.output += [5, 6, 7]
    assert sched.needed(req) == min(req.max_len, 13 + n) == (14 if n else 13)


@pytest.mark.parametrize(("prompt", "max_tokens", "field"), [(64, 1, "prompt"), (63, 1, None), (63, 2, "max_tokens"),
                                                            (65, 1, "prompt")])
def test_length_limits_at_their_boundaries(seed: int, prompt: int, max_tokens: int, field: str | None) -> None:
    """A prompt of max_model_len tokens leaves no room for a completion (the prompt is named); one token less fits
    a one-token completion and no more (then max_tokens is named)."""
    model = tiny_model(seed, sharp=False)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8),
                      ResidentKV(model.cfg, "fp8_ds_mla", page_tokens=16))
    req = Request("r", [1] * prompt, SamplingParams(max_tokens=max_tokens))
    if field is None:
        sched.check(req)
    else:
        with pytest.raises(RequestError) as err:
            sched.check(req)
        assert err.value.field == field and err.value.status == 400


def test_a_preempted_request_recomputes_from_its_first_token(seed: int) -> None:
    """Preemption frees the request's KV and queues it first with nothing computed, so its next prefill starts
    at position 0 (its tokens so far become the prompt it recomputes)."""
    model = tiny_model(seed, sharp=False)
    kv = ResidentKV(model.cfg, "fp8_ds_mla", page_tokens=16)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8), kv)
    req = Request("r", list(range(1, 11)), SamplingParams(max_tokens=4))
    sched.running.append(req)
    assert kv.reserve("r", 10)
    req.num_computed, req.status = 10, Status.RUNNING
    sched.preempt(req)
    assert req.num_computed == 0 and req.status == Status.WAITING and sched.waiting[0] is req
    assert "r" not in kv.reserved and sched.num_preemptions == 1


@pytest.mark.parametrize(("prompt", "tail", "reusable"), [(1, 1, 0), (5, 1, 4), (5, 5, 0), (5, 7, 0), (5, 2, 3)])
def test_reusable_tokens_leave_the_recompute_tail(seed: int, prompt: int, tail: int, reusable: int) -> None:
    """With prefix caching a request may start from all but its last `recompute_tail` known tokens, and from none
    when it has no more than that."""
    model = tiny_model(seed, sharp=False)
    kv = ResidentKV(model.cfg, "fp8_ds_mla", page_tokens=16, prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8), kv,
                      recompute_tail=tail)
    req = Request("r", list(range(1, prompt + 1)), SamplingParams(max_tokens=4))
    assert sched.reusable(req) == list(range(1, reusable + 1))


@pytest.mark.parametrize("fair", [0, 4])
def test_prefill_chunks_fill_the_budget_and_no_more(seed: int, fair: int) -> None:
    """Two 20-token prompts, 16 tokens a step: the first prefill chunk takes the whole budget and the second
    request waits for the next step (no empty segment); then the first's last 4 tokens and 12 of the second's.
    A lone group is not held to the fair share."""
    model = tiny_model(seed, sharp=False)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                                      fair_prefill_tokens=fair), ResidentKV(model.cfg, "fp8_ds_mla", page_tokens=16))
    for name in ("a", "b"):
        sched.add(Request(name, list(range(1, 21)), SamplingParams(max_tokens=4)))
    step = sched.schedule()
    assert [(r.id, s.start, s.length) for r, s in zip(step.reqs, step.segments)] == [("a", 0, 16)]
    step.reqs[0].num_computed = 16          # the chunk ran: a has 4 prompt tokens left, b gets the other 12
    step = sched.schedule()
    assert [(r.id, s.start, s.length) for r, s in zip(step.reqs, step.segments)] == [("a", 16, 4), ("b", 0, 12)]


def test_drafts_take_their_tokens_from_the_prefill_budget(seed: int) -> None:
    """A decoding request verifying 3 drafts costs 4 of the step's 16 tokens: a prefill beside it gets the 12
    left, so the step holds 16 tokens."""
    model = tiny_model(seed, sharp=False)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16),
                      ResidentKV(model.cfg, "fp8_ds_mla", page_tokens=16), num_speculative_tokens=3)
    dec = Request("d", list(range(1, 6)), SamplingParams(max_tokens=20, temperature=0.0))
    sched.add(dec)
    sched.schedule()
    dec.num_computed, dec.output = 5, [7]          # prefilled, first token sampled: decoding from here
    sched.add(Request("p", list(range(1, 31)), SamplingParams(max_tokens=4)))
    step = sched.schedule()
    assert [(r.id, s.length, n) for r, s, n in zip(step.reqs, step.segments, step.num_drafts)] == \
        [("d", 4, 3), ("p", 12, 0)]
