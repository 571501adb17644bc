"""The batched sampler's vLLM extensions against plain-Python references of vLLM 0.32's formulas (v1 sampler:
min_tokens, logit_bias, repetition/frequency/presence penalties, min_p) on random logits, raw logprobs, and stop
strings under min_tokens."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hisparse.engine.detokenizer import TextStream
from hisparse.engine.request import Request, SamplingParams
from hisparse.engine.sampling import (LogitsProcessors, SamplingBatch, filter_min_p, filter_top_k_top_p, sample,
                                      token_logprobs)
from hisparse.model.tiny import builtin_tiny
from hisparse.model.tokenizer import load_tokenizer

V, EOS = 48, 2


def reference_processed(row: list[float], req: Request, eos: int) -> list[float]:
    """vLLM's non-argmax-invariant processing of one row, token by token (Sampler.apply_logits_processors)."""
    p, z = req.params, list(row)
    if len(req.output) < p.min_tokens:                       # MinTokensLogitsProcessor: all_stop_token_ids
        for t in set(p.stop_token_ids) | {eos}:
            z[t] = -math.inf
    for t, b in p.logit_bias:                                # LogitBiasLogitsProcessor (clamped as from_optional)
        z[t] += min(100.0, max(-100.0, b))
    for v in range(len(z)):                                  # apply_penalties
        if v in req.prompt or v in req.output:
            z[v] = z[v] / p.repetition_penalty if z[v] > 0 else z[v] * p.repetition_penalty
        count = req.output.count(v)
        z[v] -= p.frequency_penalty * count
        z[v] -= p.presence_penalty * (count > 0)
    return z


def reference_min_p(row: list[float], min_p: float) -> list[bool]:
    """MinPLogitsProcessor: which tokens survive (probability >= min_p x the top probability)."""
    m = max(row)
    e = [math.exp(x - m) for x in row]
    probs = [x / sum(e) for x in e]
    return [q >= max(probs) * min_p for q in probs]


def random_requests(rng: random.Random, n: int) -> list[Request]:
    reqs = []
    for i in range(n):
        params = SamplingParams(
            max_tokens=32, temperature=0.0, stop_token_ids=tuple(rng.sample(range(V), 2)),
            repetition_penalty=rng.choice([1.0, 0.5, 1.3, 2.0]), presence_penalty=rng.choice([0.0, -1.0, 0.7, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.4, -2.0]), min_tokens=rng.choice([0, 3, 10]),
            logit_bias=tuple((t, rng.choice([-150.0, -3.0, 2.5, 120.0])) for t in rng.sample(range(V), rng.randint(0, 3))))
        req = Request(f"r{i}", [rng.randrange(V) for _ in range(rng.randint(1, 12))], params)
        req.output = [rng.randrange(V) for _ in range(rng.randint(0, 8))]    # repeats happen: V is small
        reqs.append(req)
    return reqs


def test_processors_match_vllm_formulas(seed: int) -> None:
    rng = random.Random(seed)
    reqs = random_requests(rng, 12)
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(seed)) * 4
    got = LogitsProcessors.from_requests(reqs, V, EOS, torch.device("cpu")).apply(logits)
    want = torch.tensor([reference_processed(row, r, EOS) for row, r in zip(logits.tolist(), reqs)])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin].float(), rtol=1e-6, atol=1e-5)
    # each formula can fail alone: a request with only that setting changes the logits
    for field, value in [("repetition_penalty", 1.5), ("frequency_penalty", 1.0), ("presence_penalty", 1.0),
                         ("min_tokens", 5), ("logit_bias", ((7, 3.0),))]:
        req = Request("x", [1, 7, 7], SamplingParams(max_tokens=8, **{field: value}))
        req.output = [7, 9, 9]
        row = logits[:1]
        out = LogitsProcessors.from_requests([req], V, EOS, torch.device("cpu")).apply(row)
        assert not torch.equal(out, row), field
        ref = torch.tensor([reference_processed(row[0].tolist(), req, EOS)])
        assert torch.equal(torch.isinf(out), torch.isinf(ref)), field
        torch.testing.assert_close(out[torch.isfinite(ref)], ref[torch.isfinite(ref)].float(), rtol=1e-6, atol=1e-5)


def test_greedy_rows_take_the_processed_argmax(seed: int) -> None:
    rng = random.Random(seed + 1)
    reqs = random_requests(rng, 16)
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(seed + 1)) * 4
    batch = SamplingBatch.from_requests(reqs, V, torch.device("cpu"), EOS)
    assert batch.processors is not None
    got = sample(logits.clone(), batch).tolist()
    want = [max(range(V), key=lambda v: z[v]) for z in
            (reference_processed(row, r, EOS) for row, r in zip(logits.tolist(), reqs))]
    assert got == want


def test_unprocessed_rows_ignore_a_processed_neighbour(seed: int) -> None:
    """A greedy row without processors takes the argmax of its own logits, in their dtype, whether or not a
    neighbour has a penalty: fp64 top-two logits 1e-9 apart tie in fp32, where argmax would take the lower id."""
    g = torch.Generator().manual_seed(seed + 3)
    logits = torch.randn(2, V, generator=g, dtype=torch.float64)
    lo, hi = torch.randperm(V, generator=g)[:2].sort().values.tolist()
    logits[0, lo], logits[0, hi] = 30.0, 30.0 + 1e-9                     # row 0's argmax is the higher id
    plain = Request("plain", [1], SamplingParams(max_tokens=8, temperature=0.0))
    penalized = Request("pen", [1], SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.5))
    alone = sample(logits[:1], SamplingBatch.from_requests([plain], V, torch.device("cpu"), EOS))
    batch = SamplingBatch.from_requests([plain, penalized], V, torch.device("cpu"), EOS)
    assert batch.processors is not None
    together = sample(logits, batch)
    assert alone.tolist() == [hi] and together[0].item() == hi
    want = reference_processed(logits[1].float().tolist(), penalized, EOS)
    assert together[1].item() == max(range(V), key=lambda v: want[v])


def test_min_p_matches_vllm(seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 2)
    z = torch.randn(8, V, generator=g) * 3
    min_p = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0])
    got = torch.isfinite(filter_min_p(z, min_p))
    want = torch.tensor([reference_min_p(row, m) for row, m in zip(z.tolist(), min_p.tolist())])
    assert torch.equal(got, want)
    assert got[0].all() and got[-1].sum() == 1 and not got[4:].all()     # min_p 0 keeps all, 1 the top only
    # sampled rows with min_p only ever draw surviving tokens
    reqs = [Request(f"s{i}", [1], SamplingParams(max_tokens=4, temperature=1.0, min_p=0.5, seed=seed + i))
            for i in range(8)]
    for r in reqs:
        r.generator = torch.Generator().manual_seed(seed + int(r.id[1:]))
    batch = SamplingBatch.from_requests(reqs, V, torch.device("cpu"))
    assert batch.min_p is not None and batch.processors is None
    for _ in range(20):
        toks = sample(z, batch)
        assert torch.isfinite(filter_min_p(z, batch.min_p)).gather(1, toks[:, None]).all()


def test_plain_requests_keep_the_fast_path() -> None:
    reqs = [Request("a", [1, 2], SamplingParams(temperature=0.7, top_k=5)), Request("b", [3], SamplingParams())]
    batch = SamplingBatch.from_requests(reqs, V, torch.device("cpu"), EOS)
    assert batch.processors is None and batch.min_p is None
    assert all(r.params.plain and r.num_drafts(3) > 0 for r in reqs)
    penalized = Request("c", [1], SamplingParams(max_tokens=8, presence_penalty=0.5))
    assert not penalized.params.plain and penalized.num_drafts(3) == 0     # decodes one token per step


def test_token_logprobs_are_raw_log_softmax(seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 3)
    logits = torch.randn(5, V, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (5,), generator=g)
    got = token_logprobs(logits, ids, [0, 1, 3, 5, 2])
    ref = torch.log_softmax(logits, -1)
    for row, lp, k in zip(range(5), got, [0, 1, 3, 5, 2]):
        assert lp.token_id == ids[row].item()
        assert math.isclose(lp.logprob, ref[row, ids[row]].item(), abs_tol=1e-5)
        assert lp.rank == int((ref[row] >= ref[row, ids[row]]).sum())
        top = ref[row].topk(k)
        assert list(lp.top_ids) == top.indices.tolist()
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(lp.top_logprobs, top.values.tolist()))


def test_stop_strings_count_after_min_tokens() -> None:
    """vLLM checks stop strings only in the text after the first min_tokens output tokens."""
    tok = load_tokenizer(builtin_tiny()).instruct_tokenizer.tokenizer
    ids = tok.encode("the cat and the dog and the end", False, False)
    head = len(tok.encode("the cat", False, False))
    for min_tokens, want in ((0, ""), (head, "the cat and ")):
        stream = TextStream(tok.decode, ("the",), min_tokens)
        shown = "".join(stream.push([i]) for i in ids) + stream.flush()
        assert stream.stopped and shown == want, min_tokens


def test_top_k_settings_map_to_the_vocabulary_bound() -> None:
    """top_k 0 and -1 are off (every token: V), a positive top_k keeps that many, and one above V keeps V."""
    params = [SamplingParams(top_k=k, temperature=1.0) for k in (-1, 0, 1, 5, 999)]
    reqs = [Request(str(i), [1], p) for i, p in enumerate(params)]
    batch = SamplingBatch.from_requests(reqs, 100, torch.device("cpu"))
    assert batch.top_k.tolist() == [100, 100, 1, 5, 100]


@pytest.mark.parametrize(("top_p", "kept"), [(1e-9, 1), (0.25, 1), (0.26, 2), (0.5, 2), (0.75, 3), (1.0, 4)])
def test_top_p_keeps_the_fewest_top_tokens_that_reach_it(top_p: float, kept: int) -> None:
    """Four equally likely tokens (exact quarters): top_p keeps the fewest top tokens whose mass reaches top_p,
    so a token whose higher-ranked mass already reaches it is dropped, and the top token always stays."""
    out = filter_top_k_top_p(torch.zeros(1, 4), torch.tensor([4]), torch.tensor([top_p]))
    assert int(torch.isfinite(out).sum()) == kept


def test_forced_ids_come_out_first_token_zero_included() -> None:
    """forced_token_ids replace the first sampled tokens, token 0 included (-1 marks a row that samples), and
    sampling resumes after them."""
    req = Request("f", [1, 2], SamplingParams(temperature=0.0, forced_token_ids=(0, 5)))
    logits = torch.zeros(1, V)
    logits[0, 9] = 1.0
    got = []
    for _ in range(3):
        got += sample(logits, SamplingBatch.from_requests([req], V, torch.device("cpu"), EOS)).tolist()
        req.output.append(got[-1])
    assert got == [0, 5, 9]
