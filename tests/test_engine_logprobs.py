"""Logprobs in the engine: prompt logprobs over chunked prefill and preemption (computed once, delivered once with
the first output) and output logprobs equal log_softmax of one full forward over the same ids."""

from __future__ import annotations

import pytest
import torch

from conftest import full_forward, tiny_model
from hisparse.engine.engine import Engine
from hisparse.engine.request import RequestOutput, SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.model.kv import ResidentKV

pytestmark = pytest.mark.usefixtures("single_thread")
K = 3
TOL = 1e-5   # logprobs are fp32 (vLLM's log_softmax dtype), the reference fp64


def test_logprobs_over_chunked_prefill_and_preemption(seed: int) -> None:
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(30, 50, (3,), generator=g)]
    kv = ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64, budget_tokens=4 * 64)   # 4 pages: preempts
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16))
    outs: dict[int, list[RequestOutput]] = {i: [] for i in range(3)}
    params = SamplingParams(max_tokens=140, temperature=0.0, logprobs=K, prompt_logprobs=K)
    reqs = [engine.add_request(p, params, sink=outs[i].append) for i, p in enumerate(prompts)]
    while engine.has_work() or not engine.inbox.empty():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        assert [bool(o.prompt_logprobs) for o in outs[i]] == [True] + [False] * (len(outs[i]) - 1)
        prompt_lps = outs[i][0].prompt_logprobs
        lps = [lp for o in outs[i] for lp in o.logprobs]
        assert len(prompt_lps) == len(p) - 1 and len(lps) == len(r.output) == 140
        ids = p + r.output
        ref = torch.log_softmax(full_forward(model, torch.tensor(ids[:-1]), "fp8_ds_mla")[0], -1)   # [T-1, V]
        for j, lp in enumerate(prompt_lps + lps):      # row j predicts token j + 1
            assert lp.token_id == ids[j + 1]
            v = ref[j, ids[j + 1]]
            assert abs(lp.logprob - v.item()) < TOL, j
            top = ref[j].topk(K)
            assert list(lp.top_ids) == top.indices.tolist(), j
            assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) < TOL
            assert int((ref[j] > v + TOL).sum()) < lp.rank <= int((ref[j] >= v - TOL).sum()), j
        assert all(lp.rank == 1 for lp in lps)          # greedy: every output token is the most likely one
