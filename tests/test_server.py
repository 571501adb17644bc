"""A real `hisparse serve` process (HiSparse KV, small hot buffer) on 127.0.0.1 driven by the official openai
client and raw HTTP: completions, chat, streaming, parsing, seeds, 16+ concurrent clients with cancellations,
a table of malformed requests, auth, and /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serving import free_port, running, wait_healthy

from hisparse.engine.generate import greedy_generate
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import builtin_tiny
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model

KEY = "test-key"
MAX_MODEL_LEN = 2048
HOT, WINDOW = 16, 8


@dataclass
class Server:
    url: str
    name: str
    ckpt: Path
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))
                out[key] = s.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds KV (every page and key freed)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["hisparse_num_requests_running"] == 0 and m["hisparse_num_requests_waiting"] == 0
                    and m["hisparse_kv_reserved_tokens"] == 0 and m["hisparse_kv_index_cache_bytes"] == 0):
                return m
            assert time.monotonic() < deadline, f"server never went idle: {m}"
            time.sleep(0.2)


@contextmanager
def launch(log: Path, *extra: str) -> Iterator[Server]:
    """Run `hisparse serve` on the built-in tiny checkpoint (HiSparse, small hot buffer) with `extra` flags until
    the block ends; output goes to `log`."""
    ckpt = builtin_tiny()   # what `hisparse serve` serves by default (cached; prompts are fresh per run)
    port = free_port()
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--model", str(ckpt), "--port", str(port),
           "--api-key", KEY, "--debug-hooks", "--max-model-len", str(MAX_MODEL_LEN), "--host-pool-gib", "0.05",
           "--hot-buffer-tokens", str(HOT), "--resident-window", str(WINDOW), "--max-num-seqs", "32",
           "--device", "cpu", "--log-level", "warning", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    url = f"http://127.0.0.1:{port}"
    with running(cmd, log, env) as proc:
        wait_healthy(proc, url, log)
        yield Server(url, ckpt.name, ckpt, log)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with launch(tmp_path_factory.mktemp("logs") / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def tok(server: Server):
    return load_tokenizer(server.ckpt)


@pytest.fixture(scope="module")
def reference(server: Server):
    """Greedy tokens of a prompt run alone in this process on all-resident KV (independent of the server)."""
    torch.set_num_threads(1)
    model = load_model(server.ckpt)

    def run(prompt: list[int], n: int) -> list[int]:
        return greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla"), prompt, n).tokens
    return run


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def prompts(n: int, seed: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 131072, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def test_startup_models_health(server: Server) -> None:
    log = server.log.read_text()
    assert "KV cache (host pool) size:" in log and "Maximum concurrency for 2,048 tokens per request" in log
    assert f"{server.url}/v1" in log
    assert "random weights" not in log      # started with --model: no note about the built-in checkpoint
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in server.client().models.list().data] == [server.name]


def test_completion_greedy_equals_reference(server: Server, tok, reference, seed: int) -> None:
    text_tok = tok.instruct_tokenizer.tokenizer
    prompt = "The capital of France is"
    ids = text_tok.encode(prompt, bos=True, eos=False)
    ref = reference(ids, 8)
    r = server.client().completions.create(model=server.name, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == text_tok.decode(ref)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    # streamed with usage in the final chunk: the same text
    chunks = list(server.client().completions.create(model=server.name, prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_model_defaults_to_the_served_one(server: Server) -> None:
    """A request without `model` (or with null or "") is for the served model, as in vLLM; the reply names it."""
    C, H = "/v1/completions", "/v1/chat/completions"
    bodies = [(C, {"prompt": "hi"}), (C, {"model": None, "prompt": "hi"}), (C, {"model": "", "prompt": [5, 6]}),
              (H, {"messages": [{"role": "user", "content": "hi"}]})]
    with httpx.Client(timeout=60, headers=auth()) as http:
        for path, body in bodies:
            r = http.post(server.url + path, json={**body, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == server.name, (body, r.text)
            assert r.json()["usage"]["completion_tokens"] == 2
        with http.stream("POST", f"{server.url}{C}", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and events and all(e["model"] == server.name for e in events)


def test_sse_ends_with_done(server: Server) -> None:
    body = {"model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=auth(), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_chat_streaming_equals_non_streaming(server: Server, tok, reference) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    client = server.client()
    r = client.chat.completions.create(model=server.name, messages=messages, max_tokens=6, temperature=0)
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    ids = tok.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.instruct_tokenizer.tokenizer.decode(reference(ids, 6))
    stream = client.chat.completions.create(model=server.name, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("max_tokens, max_completion_tokens", [(7, 3), (3, 7), (5, None), (None, 5)])
def test_chat_max_completion_tokens_wins_over_max_tokens(server: Server, max_tokens: int | None,
                                                         max_completion_tokens: int | None) -> None:
    """As in OpenAI and vLLM, a chat request's `max_completion_tokens` caps the completion when both it and the
    deprecated `max_tokens` are given, whether it is the smaller or the larger; either alone caps it too (streamed or
    not)."""
    limits = {k: v for k, v in (("max_tokens", max_tokens), ("max_completion_tokens", max_completion_tokens))
              if v is not None}
    want = max_completion_tokens or max_tokens
    body = {"model": server.name, "messages": [{"role": "user", "content": "Count to one hundred."}],
            "temperature": 0, "ignore_eos": True, **limits}
    url = f"{server.url}/v1/chat/completions"
    with httpx.Client(timeout=60, headers=auth()) as http:
        r = http.post(url, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == want and r.json()["choices"][0]["finish_reason"] == "length"
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", url, json=stream) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert s.status_code == 200 and events[-1]["usage"]["completion_tokens"] == want
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


def test_chat_reasoning_and_tool_calls_parsed(server: Server, tok) -> None:
    """The random model never emits markers, so the first output ids are forced (debug hook); the model still
    runs every step and the parsers see exactly these ids."""
    t = tok.instruct_tokenizer.tokenizer
    sp = t.get_special_token
    args = '{"city": "Paris"}'
    forced = ([sp("[THINK]")] + t.encode("Need weather.", bos=False, eos=False) + [sp("[/THINK]")] +
              [sp("[TOOL_CALLS]")] + t.encode("get_weather", bos=False, eos=False) + [sp("[ARGS]")] +
              t.encode(args, bos=False, eos=False) + [t.eos_id])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    kw = dict(model=server.name, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
              reasoning_effort="high", max_tokens=len(forced) + 5, extra_body={"debug_forced_token_ids": forced})
    client = server.client()
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "Need weather." and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(call.id) == 9 and r.usage.completion_tokens == len(forced)
    reasoning, calls, reasons = "", {}, []
    for c in client.chat.completions.create(**kw, stream=True):
        d = c.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        reasons.append(c.choices[0].finish_reason)
    assert reasoning == "Need weather." and calls == {0: {"name": "get_weather", "arguments": args}}
    assert reasons[-1] == "tool_calls"


def test_stop_string_cuts_text(server: Server, tok) -> None:
    t = tok.instruct_tokenizer.tokenizer
    forced = t.encode("alpha beta gamma delta", bos=False, eos=False)
    client = server.client()
    kw = dict(model=server.name, prompt="x", max_tokens=10, stop=["gamma"], extra_body={"debug_forced_token_ids": forced})
    r = client.completions.create(**kw)
    assert r.choices[0].text == "alpha beta " and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stream=True)]
    assert "".join(pieces) == "alpha beta " and not any("gam" in p for p in pieces)


def test_seeded_sampling_reproducible(server: Server) -> None:
    client = server.client()

    def run(seed: int) -> str:
        return client.completions.create(model=server.name, prompt="Once upon a time", max_tokens=8,
                                         temperature=1.0, top_p=0.9, seed=seed).choices[0].text
    a = run(1234)
    assert run(1234) == a and run(4321) != a


def test_concurrent_clients_and_cancellations(server: Server, tok, reference, seed: int) -> None:
    """16 greedy clients (half streaming) while 4 more cancel mid-stream: all 16 equal their lone reference and
    afterwards no request, reservation or key is left (pool usage back to baseline)."""
    base = server.wait_idle()
    ps = prompts(16, seed)
    text_tok = tok.instruct_tokenizer.tokenizer
    refs = [text_tok.decode(reference(p, 5)) for p in ps]
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(i: int) -> str:
        if i % 2:
            r = await aclient.completions.create(model=server.name, prompt=ps[i], max_tokens=5, temperature=0)
            return r.choices[0].text
        stream = await aclient.completions.create(model=server.name, prompt=ps[i], max_tokens=5, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def cancel(i: int, http: httpx.AsyncClient) -> int:
        body = {"model": server.name, "prompt": ps[i], "max_tokens": 500, "temperature": 0, "stream": True}
        seen = 0
        async with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth()) as r:
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        return seen

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[one(i) for i in range(16)], *[cancel(i, http) for i in range(4)])

    out = asyncio.run(main())
    assert out[:16] == refs
    assert out[16:] == [3] * 4
    m = server.wait_idle()
    assert m["hisparse_host_pool_usage_ratio"] == base["hisparse_host_pool_usage_ratio"] == 0.0
    aborts = 'hisparse_request_success_total{"finished_reason": "abort"}'
    assert m.get(aborts, 0) - base.get(aborts, 0) == 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_client_that_gives_up_aborts_its_request(server: Server, path: str) -> None:
    """A non-streaming client that times out is noticed (the server polls for the disconnect): its request is
    aborted in the engine rather than generating its 1,500 tokens for nobody, and all it held is freed."""
    base = server.wait_idle()
    body = {"model": server.name, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "hello"}]} if "chat" in path else {"prompt": "hello"})}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{path}", json=body, headers=auth(), timeout=httpx.Timeout(60, read=0.5))
    m = server.wait_idle()
    aborts = 'hisparse_request_success_total{"finished_reason": "abort"}'
    assert m.get(aborts, 0) - base.get(aborts, 0) == 1
    lengths = 'hisparse_request_success_total{"finished_reason": "length"}'
    assert m.get(lengths, 0) == base.get(lengths, 0)
    assert m["hisparse_host_pool_usage_ratio"] == base["hisparse_host_pool_usage_ratio"]


def bad_requests(name: str) -> list[tuple[str, object, int, str]]:
    """(path, body, status, what the error must name: the param, or a message fragment after '~')."""
    C, H = "/v1/completions", "/v1/chat/completions"
    c = {"model": name, "prompt": "hi", "max_tokens": 2}
    h = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    user = {"role": "user", "content": "hi"}
    return [
        (C, "{", 400, "~invalid JSON"), (C, "[]", 400, "~body"), (H, "not json", 400, "~invalid JSON"),
        (C, {"model": name}, 400, "prompt"), (C, {**c, "prompt": 123}, 400, "prompt"),
        (C, {**c, "prompt": []}, 400, "prompt"), (C, {**c, "prompt": [10**7]}, 400, "prompt"),
        (C, {**c, "max_tokens": 0}, 400, "max_tokens"), (C, {**c, "max_tokens": "ten"}, 400, "max_tokens"),
        (C, {**c, "temperature": 3}, 400, "temperature"), (C, {**c, "temperature": -0.5}, 400, "temperature"),
        (C, {**c, "top_p": 0}, 400, "top_p"), (C, {**c, "top_p": 1.5}, 400, "top_p"), (C, {**c, "top_k": -5}, 400, "top_k"),
        (C, {**c, "n": 129}, 400, "n"), (C, {**c, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (C, {**c, "stop": [""]}, 400, "stop"), (C, {**c, "seed": "abc"}, 400, "seed"),
        (C, {**c, "stream": "maybe"}, 400, "stream"), (C, {**c, "stream_options": {"include_usage": True}}, 400, "~stream"),
        (C, {**c, "max_tokns": 5}, 400, "max_tokns"), (C, {**c, "logprobs": 21}, 400, "logprobs"),
        (C, {**c, "echo": "yes"}, 400, "echo"), (C, {**c, "presence_penalty": 2.5}, 400, "presence_penalty"),
        (C, {**c, "logit_bias": {"a": 5}}, 400, "logit_bias"), (C, {**c, "stop_token_ids": [-3]}, 400, "stop_token_ids"),
        (C, {**c, "prompt": list(range(1000, 1100)), "max_tokens": 2000}, 400, f"~{MAX_MODEL_LEN} tokens"),
        (C, {**c, "model": "gpt-4"}, 404, "model"),
        (H, {"model": name}, 400, "messages"), (H, {**h, "messages": []}, 400, "messages"),
        (H, {**h, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0"),
        (H, {**h, "messages": [{"role": "user"}]}, 400, "messages.0"),
        (H, {**h, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0"),
        (H, {**h, "messages": [user, {"role": "tool", "content": "x"}]}, 400, "messages.1"),
        (H, {**h, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
        (H, {**h, "reasoning_effort": "low"}, 400, "reasoning_effort"),
        (H, {**h, "tools": [{"type": "function", "function": {}}]}, 400, "tools.0.function"),
        (H, {**h, "tool_choice": "sometimes"}, 400, "tool_choice"),
        (H, {**h, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (H, {**h, "response_format": {"type": "json_object"}}, 400, "response_format"),
        (H, {**h, "model": "nope"}, 404, "model"),
        # strict types, as OpenAI answers them: no coercion from strings or numbers
        (C, {**c, "stream": "yes"}, 400, "stream"), (C, {**c, "max_tokens": "16"}, 400, "max_tokens"),
        (C, {**c, "max_tokens": 16.0}, 400, "max_tokens"), (C, {**c, "ignore_eos": 1}, 400, "ignore_eos"),
        (C, {**c, "temperature": "0.5"}, 400, "temperature"), (C, {**c, "stop_token_ids": ["2"]}, 400, "stop_token_ids"),
        (C, {**c, "seed": -1}, 400, "seed"), (C, {**c, "seed": 2**64}, 400, "seed"),
        (C, {**c, "max_tokens": True}, 400, "max_tokens"), (C, {**c, "max_tokens": -1}, 400, "max_tokens"),
        (C, {**c, "top_p": "0.9"}, 400, "top_p"), (C, {**c, "temperature": None}, 400, "temperature"),
        (C, {**c, "n": 0}, 400, "n"), (C, {**c, "stop": 5}, 400, "stop"), (C, {**c, "user": 5}, 400, "user"),
        (C, {**c, "prompt": [1, "a"]}, 400, "prompt"), (C, {**c, "top_k": 1.5}, 400, "top_k"),
        (C, {**c, "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
        (H, {**h, "messages": "hi"}, 400, "messages"),
        (H, {**h, "messages": [{**user, "extra": 1}]}, 400, "messages.0"), (H, {**h, "tools": "x"}, 400, "tools"),
        # tool_choice must name a tool that exists
        (H, {**h, "tool_choice": "required"}, 400, "~needs at least one tool"),
        (H, {**h, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "~not in tools"),
        (H, {**h, "tools": [{"type": "function", "function": {"name": "g"}}],
             "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "~not in tools"),
    ]


def test_malformed_requests_get_openai_errors(server: Server) -> None:
    table = bad_requests(server.name)
    assert len(table) >= 60
    with httpx.Client(timeout=30) as http:
        for path, body, status, what in table:
            kw = {"content": body} if isinstance(body, str) else {"json": body}
            r = http.post(server.url + path, headers={**auth(), "content-type": "application/json"}, **kw)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
            if what.startswith("~"):
                assert what[1:] in err["message"], (body, err)
            else:
                assert (err["param"] or "").startswith(what), (body, err)
        over = http.post(f"{server.url}/v1/completions", headers=auth(),
                         json={"model": server.name, "prompt": list(range(1000, 1100)), "max_tokens": 2000}).json()
        assert "2048" in over["error"]["message"] and "2100" in over["error"]["message"]
        # auth: missing and wrong bearer -> 401; /health stays open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = http.post(f"{server.url}/v1/completions", headers=headers, json={"model": server.name, "prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = http.get(f"{server.url}/v1/does-not-exist", headers=auth())
        assert r.status_code == 404 and r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    # and the server still answers a good request
    r = server.client().completions.create(model=server.name, prompt="still alive?", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    server.wait_idle()


def test_extreme_sampling_values_fail_nobody(server: Server, tok, reference) -> None:
    """top_k beyond the vocabulary (even beyond int64), seed 2**64 - 1, and top_p / temperature that round to 0 in
    fp32, sent while greedy requests run: every request answers 200, the greedy ones equal their reference, and
    the vanishing top_p / temperature give the greedy tokens (not an empty distribution's token 0)."""
    ps = prompts(6, 77)
    text_tok = tok.instruct_tokenizer.tokenizer
    refs = [text_tok.decode(reference(p, 6)) for p in ps]
    odd = [{"top_k": 2**63}, {"top_k": 10**30, "seed": 2**64 - 1}, {"top_p": 1e-50}, {"temperature": 1e-39},
           {"temperature": 1e-39, "top_p": 1e-50, "top_k": 2**63}]

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=auth()) as http:
            async def one(prompt: list[int], extra: dict) -> httpx.Response:
                return await http.post(f"{server.url}/v1/completions", json={
                    "model": server.name, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra})
            greedy = [one(p, {}) for p in ps]
            extreme = [one(ps[i % len(ps)], extra) for i, extra in enumerate(odd)]
            return await asyncio.gather(*greedy, *extreme)

    out = asyncio.run(main())
    assert [r.status_code for r in out] == [200] * len(out), [r.text for r in out if r.status_code != 200]
    texts = [r.json()["choices"][0]["text"] for r in out]
    assert texts[:len(ps)] == refs
    assert texts[len(ps) + 2:] == refs[2:len(odd)]            # vanishing top_p / temperature: the argmax
    assert "hisparse_request_success_total" in httpx.get(f"{server.url}/metrics").text
    server.wait_idle()


@pytest.mark.slow
def test_load_with_cancellations_leaves_nothing_behind(server: Server, seed: int) -> None:
    """48 concurrent clients for ~40 s: completions and chat, streaming or not, greedy or seeded sampling,
    random lengths, and about one request in five cancelled mid-way. Every request that was not cancelled
    succeeds, and afterwards every gauge (running, waiting, reserved tokens, pool usage, index-cache bytes) is 0."""
    base = server.wait_idle()
    rng = random.Random(seed)
    deadline = time.monotonic() + 40
    outcomes: Counter = Counter()
    failures: list[str] = []

    async def client(i: int, http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            chat, stream, cancel = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.2
            body = {"model": server.name, "max_tokens": rng.randint(1, 40), "temperature": rng.choice([0, 0.8]),
                    "seed": rng.randrange(2**64), "stream": stream or cancel}
            text = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(1, 300)))
            if chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            path = "/v1/chat/completions" if chat else "/v1/completions"
            if cancel:
                async with http.stream("POST", server.url + path, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and rng.random() < 0.3:
                            break
                outcomes["cancelled"] += 1
                continue
            if stream:
                async with http.stream("POST", server.url + path, json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                ok = r.status_code == 200 and lines[-1:] == ["data: [DONE]"] and \
                    not any(x.startswith('data: {"error"') for x in lines)
                seen = f"{r.status_code} {lines[-2:]}"
            else:
                r = await http.post(server.url + path, json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
                seen = f"{r.status_code} {r.text[:300]}"
            outcomes["ok" if ok else "failed"] += 1
            if not ok:
                failures.append(f"{path} {body['max_tokens']} max_tokens: {seen}")

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=auth(),
                                     limits=httpx.Limits(max_connections=64)) as http:
            await asyncio.gather(*[client(i, http) for i in range(48)])

    asyncio.run(main())
    assert outcomes["failed"] == 0 and outcomes["ok"] > 48 and outcomes["cancelled"] > 0, (outcomes, failures[:5])
    m = server.wait_idle()
    assert m["hisparse_host_pool_usage_ratio"] == base["hisparse_host_pool_usage_ratio"] == 0.0


def test_health_answers_head(server: Server) -> None:
    assert httpx.head(f"{server.url}/health").status_code == 200


def test_api_key_from_the_environment_and_a_warning_off_loopback(tmp_path: Path) -> None:
    """$HISPARSE_API_KEY protects /v1 without --api-key; a non-loopback address without a key warns; started
    without --model, the log says the built-in checkpoint is random."""
    port, log = free_port(), tmp_path / "env.log"
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--device", "cpu",
           "--log-level", "warning", "--max-model-len", "256", "--host-pool-gib", "0.05"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HISPARSE_API_KEY="from-env")
    url = f"http://127.0.0.1:{port}"
    with running(cmd, log, env) as proc:
        wait_healthy(proc, url, log)
        body = {"model": "x", "prompt": "hi", "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert ok.status_code == 200
    text = log.read_text()
    assert "WARNING" not in text and "from-env" not in " ".join(cmd)
    # no --model: one line says the built-in checkpoint is random and names the trained one
    (note,) = [line for line in text.splitlines() if "random weights" in line]
    assert "built-in tiny checkpoint" in note and "--model checkpoints/needle-ml4" in note
    port, log = free_port(), tmp_path / "open.log"
    env.pop("HISPARSE_API_KEY")
    cmd[cmd.index("--port") + 1] = str(port)
    with running(cmd + ["--host", "0.0.0.0"], log, env) as proc:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
    assert "WARNING: listening on 0.0.0.0 without an API key" in log.read_text()


def test_big_bodies_are_refused_without_blocking_the_server(server: Server) -> None:
    """A 50 MB body gets 413 at once (from its Content-Length; sent chunked, once the limit is passed), /health
    answers meanwhile, and a prompt that alone exceeds the context names `prompt` (`messages` for chat)."""
    big = {"model": server.name, "prompt": "word " * 10_000_000, "max_tokens": 1}
    with httpx.Client(timeout=60, headers=auth()) as http:
        t0 = time.monotonic()
        r = http.post(f"{server.url}/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert time.monotonic() - t0 < 10
        chunks = (b'{"model": "x", "prompt": "' + b"w" * 65536 for _ in range(40))
        r = http.post(f"{server.url}/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert http.get(f"{server.url}/health").status_code == 200
        long_text = " ".join(f"w{i}" for i in range(3000))
        r = http.post(f"{server.url}/v1/completions", json={"model": server.name, "prompt": long_text, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = http.post(f"{server.url}/v1/chat/completions", json={
            "model": server.name, "messages": [{"role": "user", "content": long_text}], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    server.wait_idle()


def test_slow_bodies_long_requests_and_a_bounded_shutdown(tmp_path: Path) -> None:
    """On a host pool that holds one maximal request: a client that sends 1 of 1,000 body bytes gets 408 after
    --read-timeout, one that sends half its headers is disconnected; a request allowed the whole pool (max_tokens up to max_model_len) does not hold it, so a short
    request sent while it streams finishes within seconds; on SIGTERM the long stream ends with a 'server
    shutting down' error event after --shutdown-timeout, a half-sent request holds nothing, and the server exits
    0."""
    port, log = free_port(), tmp_path / "shutdown.log"
    pool_tokens = 5440                                  # --host-pool-gib 0.002 of the built-in tiny checkpoint
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--device", "cpu", "--log-level",
           "warning", "--max-model-len", str(pool_tokens), "--host-pool-gib", "0.002", "--read-timeout", "1",
           "--shutdown-timeout", "2"]
    url = f"http://127.0.0.1:{port}"
    name = builtin_tiny().name

    def raw(request: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(request)
        return sock

    with running(cmd, log, dict(os.environ, OMP_NUM_THREADS="1")) as proc:
        wait_healthy(proc, url, log)
        assert f"KV cache (host pool) size: {pool_tokens:,} tokens" in log.read_text()
        slow = raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 1000\r\n\r\n{")
        t0 = time.monotonic()
        reply = ""
        while "request_timeout" not in reply and (chunk := slow.recv(4096)):
            reply += chunk.decode()
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply and time.monotonic() - t0 < 10
        silent = raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")      # headers never finished
        t0 = time.monotonic()
        assert silent.recv(4096) == b"" and time.monotonic() - t0 < 10      # closed after --read-timeout
        silent = raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        events: list[str] = []
        body = {"model": name, "prompt": "count", "max_tokens": pool_tokens - 10, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    t0 = time.monotonic()
                    short = httpx.post(f"{url}/v1/completions", timeout=30, json={
                        "model": name, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
                    assert time.monotonic() - t0 < 5
                    proc.send_signal(signal.SIGTERM)
                    t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 2 + 10
        silent.close()
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert errors and "server shutting down" in errors[0]["message"], events[-3:]
    assert events[-1] == "[DONE]" and len(events) < pool_tokens


def test_metrics_move_during_long_context_request(server: Server) -> None:
    """A prompt far longer than the hot buffer: misses and host->device bytes grow, tokens are counted."""
    before = server.wait_idle()
    n_prompt, n_new = 600, 4
    prompt = prompts(1, 7, n_prompt, n_prompt + 1)[0]
    r = server.client().completions.create(model=server.name, prompt=prompt, max_tokens=n_new, temperature=0)
    assert r.usage.completion_tokens == n_new
    after = server.wait_idle()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["hisparse_prompt_tokens_total"] == n_prompt
    assert delta["hisparse_generation_tokens_total"] == n_new
    assert delta["hisparse_time_to_first_token_seconds_count"] == 1
    assert delta["hisparse_time_per_output_token_seconds_count"] == n_new - 1
    assert delta["hisparse_cache_misses_total"] > 0 and delta["hisparse_cache_hits_total"] > 0
    assert delta["hisparse_host_to_device_bytes_total"] > 0 and delta["hisparse_device_to_host_bytes_total"] > 0
    assert after["hisparse_host_pool_usage_ratio"] == 0.0
