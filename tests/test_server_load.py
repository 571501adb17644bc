"""A real `hisparse serve` process under concurrent clients: 16+ clients with cancellations, non-streaming clients
that give up, extreme sampling values beside greedy requests, a load test, and the metrics of a long-context request;
afterwards nothing is left running or held."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import openai
import pytest
from serving import KEY, Server, auth, prompts, reference, server, tok  # noqa: F401  (fixtures)


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
