"""Which request the scheduler preempts when the KV store is full: the newest running one (the one admitted last),
so the oldest requests always make progress (vLLM's recompute policy)."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import tiny_model
from hisparse.engine.engine import Engine
from hisparse.engine.request import Request, SamplingParams, Status
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.kv.resident import ResidentKV

pytestmark = pytest.mark.usefixtures("single_thread")

PAGE = 16


def run_recording_victims(seed: int, prompt_lens: list[int], max_tokens: int, pages: int
                          ) -> tuple[list[Request], list[str]]:
    """Run greedy requests (submitted in order) on a `pages`-page resident store; at every preemption check that
    the victim was admitted after every request still running. Returns the requests and the victims' ids in
    order."""
    model = tiny_model(seed, sharp=False)
    kv = ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64, budget_tokens=pages * PAGE, page_tokens=PAGE)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64))
    sched = engine.scheduler
    admitted: dict[str, int] = {}          # request id -> admission number (larger: admitted later)
    admissions = itertools.count()
    victims: list[str] = []
    notify = sched.on_preempt

    def on_preempt(req: Request) -> None:
        others = {r.id: admitted[r.id] for r in sched.running}
        assert req.id not in others and req.status == Status.WAITING and sched.waiting[0] is req
        assert all(admitted[req.id] > n for n in others.values()), \
            f"preempted {req.id} (admission {admitted[req.id]}) while newer requests ran: {others}"
        victims.append(req.id)
        del admitted[req.id]
        notify(req)
    sched.on_preempt = on_preempt

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist(), params)
            for n in prompt_lens]
    while engine.has_work() or not engine.inbox.empty():
        engine.step()
        for r in sched.running:            # preemptions happen before admissions, so no step hides one
            if r.id not in admitted:
                admitted[r.id] = next(admissions)
    assert all(len(r.output) == max_tokens and r.finish_reason == "length" for r in reqs)
    assert kv.reserved == {}
    return reqs, victims


def test_a_full_store_preempts_the_newest_running_request(seed: int) -> None:
    """Three one-page requests on a four-page store, admitted together: when the oldest has taken the last free
    page, the second needs one more and the third (the newest) is preempted, not the oldest; later the second
    gives way to the oldest."""
    reqs, victims = run_recording_victims(seed, [10, 10, 10], max_tokens=40, pages=4)
    assert victims[:2] == [reqs[2].id, reqs[1].id], victims


def test_the_newest_request_preempts_itself_when_it_is_the_one_growing(seed: int) -> None:
    """Two requests on a two-page store; the newer one (longer prompt) outgrows its page first: it is the newest
    running request, so it is the one preempted, and the older one keeps its KV."""
    reqs, victims = run_recording_victims(seed, [5, 12], max_tokens=20, pages=2)
    assert victims == [reqs[1].id], victims
