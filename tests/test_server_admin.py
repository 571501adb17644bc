"""A real `hisparse serve` process's lifecycle and guards: startup, /v1/models and /health, a table of malformed
requests (OpenAI-shaped errors), auth (flag and environment), oversized and slow bodies, and a bounded shutdown."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serving import (KEY, MAX_MODEL_LEN, Server, auth, free_port, reference, running, server, tok,  # noqa: F401
                     wait_healthy)

from hisparse.model.tiny import builtin_tiny


def test_startup_models_health(server: Server) -> None:
    log = server.log.read_text()
    assert "KV cache (host pool) size:" in log and "Maximum concurrency for 2,048 tokens per request" in log
    assert re.search(r"Device KV budget: [\d,]+ bytes = working sets of [\d,]+ bytes for at most [\d,]+ running "
                     r"requests\n", log), "the budget's line (--kv-offload hisparse: no resident pages)"
    assert f"{server.url}/v1" in log
    assert "random weights" not in log      # started with --model: no note about the built-in checkpoint
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in server.client().models.list().data] == [server.name]


def test_health_answers_head(server: Server) -> None:
    assert httpx.head(f"{server.url}/health").status_code == 200


def test_prefix_cache_hits_and_reset(server: Server, tok, reference) -> None:
    """Two questions over one 300-token document, one after the other: the second prefills only what follows the
    document's cached pages (hisparse_prefix_cache_hits), both answers equal the all-resident reference; after
    POST /reset_prefix_cache the cache is empty and the same question hits nothing."""
    g = torch.Generator().manual_seed(17)
    doc = torch.randint(1000, 131072, (300,), generator=g).tolist()
    qs = [doc + torch.randint(1000, 131072, (n,), generator=g).tolist() for n in (9, 14)]

    def ask(prompt: list[int]) -> str:
        return server.client().completions.create(model=server.name, prompt=prompt, max_tokens=6,
                                                  temperature=0).choices[0].text

    before = server.wait_idle()
    answers = [ask(q) for q in qs]
    after = server.wait_idle()
    assert answers == [tok.instruct_tokenizer.tokenizer.decode(reference(q, 6)) for q in qs]
    hits = after["hisparse_prefix_cache_hits_total"] - before["hisparse_prefix_cache_hits_total"]
    assert hits >= 256 and after["hisparse_prefix_cache_pages"] > 0     # the document's full pages, 64 tokens each
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401      # an admin route: the API key
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=auth())
    assert r.status_code == 200 and r.json()["dropped_pages"] == after["hisparse_prefix_cache_pages"]
    assert ask(qs[1]) == answers[1]
    m = server.wait_idle()
    assert m["hisparse_prefix_cache_hits_total"] == after["hisparse_prefix_cache_hits_total"]


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
