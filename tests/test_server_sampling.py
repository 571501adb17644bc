"""vLLM's extensions through a real `hisparse serve` (HiSparse KV, small hot buffer) and the official openai client:
logprobs and echo equal log_softmax of `hisparse logits` on the same ids, penalties match a plain-Python reference
of vLLM's formulas end to end, n seeded choices are reproducible and differ, /tokenize, /detokenize, /version, and
which vLLM fields are accepted, ignored or refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from test_sampling_processors import reference_processed
from serving import KEY, Server, auth, launch

from hisparse.engine.request import Request, SamplingParams
from hisparse.model.tokenizer import load_tokenizer

# The server and the reference compute in fp64, so their different schedules (chunked prefill, one-row decode
# steps, HiSparse gathers vs one full forward) round alike to ~1e-13. In fp32 they do not: the indexer's ReLU
# scores leave exact-zero ties at the top-k boundary, and fp32 rounding that makes one of those scores a tiny
# positive number selects another key, which moves that position's logits (and those of later positions reading
# its KV) by up to ~1e-3. What remains is the fp32 of the logprobs the API returns (vLLM's log_softmax dtype).
TOL = 1e-5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with launch(tmp_path_factory.mktemp("logs") / "serve.log", "--dtype", "float64") as s:
        yield s


@pytest.fixture(scope="module")
def tok(server: Server):
    return load_tokenizer(server.ckpt).instruct_tokenizer.tokenizer


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(), timeout=120)


def ref_logits(server: Server, ids: list[int], tmp_path: Path) -> torch.Tensor:
    """`hisparse logits` (the CLI's full forward, in the server's KV row format and dtype) -> [T, V] fp64."""
    out = tmp_path / f"logits-{len(ids)}.npy"
    subprocess.run([sys.executable, "-m", "hisparse.cli", "logits", "--model", str(server.ckpt), "--prompt-ids",
                    ",".join(map(str, ids)), "--kv-layout", "fp8_ds_mla", "--dtype", "float64", "--device", "cpu",
                    "--out", str(out)], check=True,
                   capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return torch.from_numpy(np.load(out)).double()


def ref_logprobs(server: Server, ids: list[int], tmp_path: Path) -> torch.Tensor:
    """log_softmax of `hisparse logits` -> [T, V] fp64."""
    return torch.log_softmax(ref_logits(server, ids, tmp_path), -1)


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 131072, (n,), generator=g).tolist()


def test_completion_logprobs_and_echo_equal_hisparse_logits(server: Server, tok, seed: int, tmp_path: Path) -> None:
    ids, k = prompt_ids(40, seed), 3
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": k,
                                         "echo": True, "prompt_logprobs": k, "return_token_ids": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    out, lp = c["token_ids"], c["logprobs"]
    assert c["prompt_token_ids"] == ids and len(out) == 6
    assert c["text"].startswith(tok.decode(ids)) and len(lp["tokens"]) == len(ids) + 6
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and c["prompt_logprobs"][0] is None
    ref = ref_logprobs(server, ids + out, tmp_path)
    for j, tid in enumerate(ids + out):
        if j == 0:
            continue
        row = ref[j - 1]
        assert abs(lp["token_logprobs"][j] - row[tid].item()) < TOL, j
        assert lp["tokens"][j] == tok.decode([tid])
        top = row.topk(k).values.tolist()
        got = lp["top_logprobs"][j]       # the token itself and the top-k, keyed by text
        assert max(abs(a - b) for a, b in zip(sorted(got.values(), reverse=True)[:k], top)) < TOL, j
        assert got[lp["tokens"][j]] == lp["token_logprobs"][j]
        if j >= len(ids):     # generated greedily: a most likely token of the model's logits (up to TOL)
            assert row[tid] >= row.max() - TOL
        else:                 # vLLM's prompt_logprobs field, keyed by id, with ranks
            pl = c["prompt_logprobs"][j]
            v = row[tid]      # its rank, up to the tokens within TOL of it
            assert int((row > v + TOL).sum()) < pl[str(tid)]["rank"] <= int((row >= v - TOL).sum())
            alts = sorted(((e["rank"], int(i)) for i, e in pl.items() if int(i) != tid or e["rank"] <= k))[:k]
            assert [r for r, _ in alts] == list(range(1, k + 1))      # ranks 1..k, each id's logprob the r-th
            assert all(abs(row[i].item() - top[r - 1]) < TOL and abs(pl[str(i)]["logprob"] - top[r - 1]) < TOL
                       for r, i in alts), j
    # text offsets run over the token texts
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]


def test_echo_without_generation_scores_the_prompt(server: Server, seed: int, tmp_path: Path) -> None:
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0 -> the prompt's logprobs only."""
    ids = prompt_ids(24, seed + 1)
    r = server.client().completions.create(model=server.name, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                           temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    ref = ref_logprobs(server, ids, tmp_path)
    got = torch.tensor(lp.token_logprobs[1:], dtype=torch.float64)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max() < TOL


def test_batched_prompts_scored_as_lm_eval_does(server: Server, seed: int, tmp_path: Path) -> None:
    """lm-eval's local-completions loglikelihood: a batch of token-id prompts, echo, logprobs 1, max_tokens 1;
    it sums token_logprobs[ctxlen:-1] of each choice (sorted by index). Text prompts batch the same way."""
    ids = [prompt_ids(20, seed + 10), prompt_ids(31, seed + 11)]
    body = {"prompt": ids, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    r = post(server, "/v1/completions", body).json()
    choices = sorted(r["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1] and r["usage"]["prompt_tokens"] == 51
    for c, p in zip(choices, ids):
        lps = c["logprobs"]["token_logprobs"]
        assert len(lps) == len(p) + 1 and lps[0] is None
        ctx = 5     # the continuation: tokens 5.. of the prompt
        ref = ref_logprobs(server, p, tmp_path)
        want = sum(ref[j - 1, p[j]].item() for j in range(ctx, len(p)))
        assert abs(sum(lps[ctx:-1]) - want) < TOL * len(p)
    # n choices per prompt: prompt j's choice i has index j x n + i; text prompts as well
    r = post(server, "/v1/completions", {"prompt": ["Hello", "Good night"], "n": 2, "max_tokens": 3,
                                         "temperature": 0, "return_token_ids": True}).json()
    by_index = {c["index"]: c for c in r["choices"]}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0]["token_ids"] == by_index[1]["token_ids"] != by_index[2]["token_ids"] == by_index[3]["token_ids"]
    alone = post(server, "/v1/completions", {"prompt": "Good night", "max_tokens": 3, "temperature": 0,
                                             "return_token_ids": True}).json()["choices"][0]
    assert by_index[2]["prompt_token_ids"] == alone["prompt_token_ids"] and by_index[2]["token_ids"] == alone["token_ids"]
    assert r["usage"]["completion_tokens"] == 12


def test_chat_logprobs_equal_hisparse_logits(server: Server, tok, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Tell me about sparse attention and host memory."}]
    prompt = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    r = server.client().chat.completions.create(model=server.name, messages=messages, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=2)
    assert r.usage.prompt_tokens == len(prompt)
    content = r.choices[0].logprobs.content
    # the same greedy ids through completions (prompt ids in, token ids out)
    out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                           "return_token_ids": True}).json()["choices"][0]["token_ids"]
    assert len(content) == len(out) == 5
    ref = ref_logprobs(server, prompt + out, tmp_path)
    for t, (entry, tid) in enumerate(zip(content, out)):
        row = ref[len(prompt) - 1 + t]
        assert entry.token == tok.decode([tid]) and abs(entry.logprob - row[tid].item()) < TOL
        assert entry.bytes == list(entry.token.encode())
        top = row.topk(2)
        assert len(entry.top_logprobs) == 2
        assert all(abs(e.logprob - v) < TOL for e, v in zip(entry.top_logprobs, top.values.tolist()))
        texts = {tok.decode([i]) for i in (row >= top.values[-1] - TOL).nonzero().flatten().tolist()}
        assert {e.token for e in entry.top_logprobs} <= texts     # the top ids, up to near-ties


def test_penalties_end_to_end_match_vllm_reference(server: Server, seed: int, tmp_path: Path) -> None:
    ids = prompt_ids(12, seed + 2) * 2        # repeated prompt tokens: the repetition penalty's prompt half
    plain = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 10, "temperature": 0,
                                             "return_token_ids": True}).json()["choices"][0]["token_ids"]
    boosted = next(t for t in range(2000, 3000) if t not in ids and t not in plain)
    params = dict(repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=0.6, min_tokens=4,
                  logit_bias=((boosted, 3.0), (ids[5], -0.2)))
    r = post(server, "/v1/completions", {
        "prompt": ids, "max_tokens": 10, "temperature": 0, "return_token_ids": True,
        "logit_bias": {str(t): b for t, b in params["logit_bias"]},
        **{k: v for k, v in params.items() if k != "logit_bias"}})
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]["token_ids"]
    assert out[0] == boosted and out != plain    # the processors changed the greedy choice
    logits = ref_logits(server, ids + out, tmp_path)
    eos = load_tokenizer(server.ckpt).instruct_tokenizer.tokenizer.eos_id
    req = Request("ref", ids, SamplingParams(max_tokens=10, **params))
    for t, tid in enumerate(out):
        req.output = out[:t]
        z = reference_processed(logits[len(ids) - 1 + t].tolist(), req, eos)
        assert z[tid] >= max(z) - TOL, t      # the processed argmax (up to server-vs-reference rounding)


def test_n_seeded_choices_reproducible_and_different(server: Server, seed: int) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "n": 4, "seed": seed,
            "return_token_ids": True}
    first = post(server, "/v1/completions", body).json()
    again = post(server, "/v1/completions", body).json()
    ids = [c["token_ids"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3] and len({tuple(x) for x in ids}) == 4
    assert [c["token_ids"] for c in again["choices"]] == ids
    assert first["usage"]["completion_tokens"] == 32
    # choice i is the request with seed + i alone, whatever else runs beside it
    singles = [post(server, "/v1/completions", {**body, "n": 1, "seed": seed + i}).json()["choices"][0]["token_ids"]
               for i in range(4)]
    assert singles == ids
    # streamed: the same choices, and one usage chunk for all of them
    streamed: dict[int, list[int]] = {i: [] for i in range(4)}
    usage = []
    with httpx.stream("POST", server.url + "/v1/completions", headers=auth(), timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                for ch in ev["choices"]:
                    streamed[ch["index"]] += ch["token_ids"]
                if ev.get("usage"):
                    usage.append(ev["usage"])
    assert [streamed[i] for i in range(4)] == ids and len(usage) == 1 and usage[0]["completion_tokens"] == 32
    chat = server.client().chat.completions.create(model=server.name, n=3, seed=seed, temperature=1.0, max_tokens=6,
                                                   messages=[{"role": "user", "content": "Hi"}])
    assert len(chat.choices) == 3 and len({c.message.content for c in chat.choices}) == 3


def test_tokenize_detokenize_version(server: Server, tok) -> None:
    r = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world", True, False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 2048 and r["token_strs"] == [tok.id_to_piece(t) for t in r["tokens"]]
    plain = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["tokens"] == r["tokens"][1:] and plain["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": "Hello world"}
    usage = server.client().completions.create(model=server.name, prompt="Hello world", max_tokens=1).usage
    assert usage.prompt_tokens == r["count"]
    assert httpx.get(server.url + "/version").json()["version"]
    for path, body, status, param in [
            ("/detokenize", {"tokens": [-1]}, 400, "tokens"), ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
            ("/tokenize", {"prompt": 5}, 400, "prompt"), ("/tokenize", {"prompt": "x", "foo": 1}, 400, "foo"),
            ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
            ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0")]:
        resp = post(server, path, body)
        assert resp.status_code == status and resp.json()["error"]["param"].startswith(param), (body, resp.text)


def test_vllm_fields_accepted_ignored_or_refused(server: Server) -> None:
    base = {"prompt": "hi", "max_tokens": 2}
    ignored = {"request_id": "abc", "session_id": "s", "priority": 0, "cache_salt": "salt", "vllm_xargs": {"a": 1},
               "skip_special_tokens": False, "spaces_between_special_tokens": True, "stream_interval": 2,
               "truncation_side": "left", "length_penalty": 1.0, "user": "u"}
    neutral = {"use_beam_search": False, "allowed_token_ids": None, "bad_words": [], "include_stop_str_in_output":
               False, "truncate_prompt_tokens": None, "watermarking": False, "min_p": 0.0, "best_of": 1,
               "repetition_penalty": 1.0, "logprobs": None, "add_special_tokens": True}
    r = post(server, "/v1/completions", {**base, **ignored, **neutral})
    assert r.status_code == 200, r.text
    assert "request fields accepted and ignored: cache_salt, length_penalty" in server.log.read_text()
    h = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(server, "/v1/chat/completions", {**h, "add_generation_prompt": True, "include_reasoning": True,
                                                 "mm_processor_kwargs": {}, "top_logprobs": 0}).status_code == 200
    for path, body, param in [
            ("/v1/completions", {**base, "use_beam_search": True}, "use_beam_search"),
            ("/v1/completions", {**base, "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
            ("/v1/completions", {**base, "bad_words": ["x"]}, "bad_words"),
            ("/v1/completions", {**base, "best_of": 3}, "best_of"),
            ("/v1/completions", {**base, "repetition_penalty": 0}, "repetition_penalty"),
            ("/v1/completions", {**base, "min_p": 1.5}, "min_p"),
            ("/v1/completions", {**base, "min_tokens": 5}, "min_tokens"),
            ("/v1/completions", {**base, "logit_bias": {"999999999": 1}}, "logit_bias"),
            ("/v1/completions", {**base, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
            ("/v1/completions", {**base, "max_tokens": 0}, "max_tokens"),
            ("/v1/completions", {**base, "frobnicate": 1}, "frobnicate"),
            ("/v1/completions", {**base, "prompt": [[1, 2], []]}, "prompt"),
            ("/v1/completions", {**base, "prompt": ["a", [1]]}, "prompt"),
            ("/v1/chat/completions", {**h, "top_logprobs": 2}, "top_logprobs"),
            ("/v1/chat/completions", {**h, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/chat/completions", {**h, "echo": True}, "echo"),
            ("/v1/chat/completions", {**h, "chat_template": "x"}, "chat_template")]:
        resp = post(server, path, body)
        assert resp.status_code == 400 and (resp.json()["error"]["param"] or "").startswith(param), (body, resp.text)
    server.wait_idle()
