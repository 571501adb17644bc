"""The scheduler's settings and defaults: checked once and immutable after; without speculation a request
reserves exactly its known tokens."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_model
from hisparse.engine.request import Request, SamplingParams
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
