"""Logprobs in the engine: prompt logprobs over chunked prefill and preemption (computed once, delivered once with
the first output) and output logprobs equal log_softmax of one full forward over the same ids; under speculative
decoding, requests with logits processors or logprobs decode without drafts and exactly as without speculation."""

from __future__ import annotations

import pytest
import torch

from conftest import full_forward, tiny_model
from hisparse.engine.engine import Engine
from hisparse.engine.request import RequestOutput, SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.engine.speculative import SpeculativeConfig
from hisparse.model.dspark import DSparkDrafter
from hisparse.kv.resident import ResidentKV
from test_engine_speculative import FAST, SCHED

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
            assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) < TOL
            # the top ids, up to fp32 near-ties: each id's reference logprob is the k-th largest
            assert max(abs(ref[j, i].item() - b) for i, b in zip(lp.top_ids, top.values.tolist())) < TOL, j
            assert int((ref[j] > v + TOL).sum()) < lp.rank <= int((ref[j] >= v - TOL).sum()), j
        assert all(lp.logprob == lp.top_logprobs[0] for lp in lps)    # greedy: each output is a most likely token


class RecordingDrafter(DSparkDrafter):
    """The checkpoint's drafter, noting which requests it drafts for."""

    def __init__(self, model):
        super().__init__(model)
        self.drafted: set[str] = set()

    def propose_batch(self, reqs, anchors, pos, n, sample):
        self.drafted.update(reqs)
        return super().propose_batch(reqs, anchors, pos, n, sample)


def test_processed_requests_decode_without_drafts_under_speculation(seed: int) -> None:
    """With speculative decoding on, a request with penalties and logprobs takes the plain sampler (no drafts) and
    gets exactly the tokens and logprobs of an engine without speculation; a plain neighbour still drafts."""
    model = tiny_model(seed, **FAST)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.cfg.vocab_size, (40,), generator=g).tolist() for _ in range(2)]
    params = [SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                             logprobs=2)]
    runs = []
    for spec in (None, SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": 3}, model.cfg)):
        drafter = RecordingDrafter(model)
        engine = Engine(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64), SCHED, speculative=spec,
                        proposer=drafter)
        outs: dict[str, list[RequestOutput]] = {"plain": [], "processed": []}
        reqs = [engine.add_request(p, sp, rid, outs[rid].append)
                for p, sp, rid in zip(prompts, params, ("plain", "processed"))]
        while engine.has_work() or not engine.inbox.empty():
            engine.step()
        runs.append(([r.output for r in reqs], [lp for o in outs["processed"] for lp in o.logprobs], drafter.drafted))
    (plain_out, plain_lps, _), (spec_out, spec_lps, drafted) = runs
    assert spec_out == plain_out and drafted == {"plain"}
    assert len(spec_lps) == 24 and spec_lps == plain_lps
