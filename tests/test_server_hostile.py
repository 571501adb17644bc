"""One client's request cannot hurt the server: a real `hisparse serve` process driven over HTTP with requests
that are rejected part-way, malformed in ways the validators miss, oversized in fan-out, or heavy, while other
requests (on the same keep-alive connection, or beside them) must keep working."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import KEY, MAX_MODEL_LEN, Server, free_port, launch

ROOT = Path(__file__).resolve().parents[1]


BODY_LIMIT = 16 << 20   # room for a million-token /tokenize body
POLL = """
import asyncio, json, os, sys, time, httpx
url, stop = sys.argv[1], sys.argv[2]


async def main():
    lat = []
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=500)) as c:
        async def probe(t0):
            assert (await c.get(url + "/health")).status_code == 200
            lat.append(time.perf_counter() - t0)
        tasks, t = [], time.perf_counter()
        while not os.path.exists(stop):   # open loop: one probe every 20 ms, whether or not the last returned
            tasks.append(asyncio.ensure_future(probe(t)))
            t += 0.02
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
        await asyncio.gather(*tasks)
    print(json.dumps(lat))
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch(tmp_path_factory.mktemp("logs") / "serve.log", "--max-request-bytes", str(BODY_LIMIT)) as s:
        yield s


@pytest.fixture
def keepalive(server: Server) -> Iterator[httpx.Client]:
    """One keep-alive connection to the server."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      limits=httpx.Limits(max_connections=1)) as c:
        yield c


def test_a_rejected_batch_leaves_nothing_running(server: Server, keepalive: httpx.Client) -> None:
    """The second prompt is too long: the whole request is a 400 and none of the first prompt's choices run."""
    budget = MAX_MODEL_LEN - 8
    r = keepalive.post("/v1/completions", json={"prompt": [[1, 2, 3], [1] * (MAX_MODEL_LEN - 4)], "max_tokens": budget,
                                           "n": 4, "ignore_eos": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    time.sleep(0.5)   # several engine steps
    m = server.metrics()
    assert m["hisparse_num_requests_running"] == 0 and m["hisparse_kv_reserved_tokens"] == 0, m
    server.wait_idle(timeout=5)


def post_raw(conn: http.client.HTTPConnection, path: str, body: str) -> tuple[int, dict, dict[str, str]]:
    """POST a raw JSON text on `conn`; (status, parsed body, lower-cased headers)."""
    conn.request("POST", path, body.encode(), {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.getheaders()}


BAD_INPUTS = [   # (path, raw JSON body, the field the 4xx names)
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1, "logit_bias": {"--5": 1}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1, "logit_bias": {"\u00b2": 1}}', "logit_bias"),
    ("/v1/completions", json.dumps({"prompt": " " * 1_000_000, "max_tokens": 1}), "prompt"),
    ("/tokenize", json.dumps({"prompt": " " * 1_000_000}), "prompt"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1, "echo": true}', "prompt"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1, "echo": true, "stream": true}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1, "model": "\\udc00"}', "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "messages"),
    ("/tokenize", '{"prompt": "\\udfff", "return_token_strs": true}', "prompt"),
]


@pytest.mark.parametrize("path,body,field", BAD_INPUTS, ids=range(len(BAD_INPUTS)))
def test_client_input_is_a_4xx_and_the_connection_stays_usable(server: Server, path: str, body: str,
                                                                field: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
    try:
        status, err, headers = post_raw(conn, path, body)
        assert 400 <= status < 500 and err["error"]["param"] == field, (status, err)
        assert headers.get("connection") != "close"
        sock = conn.sock
        status, ok, _ = post_raw(conn, "/v1/completions", '{"prompt": "next", "max_tokens": 2}')
        assert status == 200 and ok["usage"]["completion_tokens"] == 2 and conn.sock is sock
    finally:
        conn.close()


LIMITED = [   # (body, status, the field the error names, text in its message)
    ({"prompt": [[1, 2]] * 128, "n": 128, "max_tokens": 1}, 400, "n", "--max-batch-fanout"),
    ({"prompt": [[1, 2]] * 3, "n": 100, "max_tokens": 1}, 400, "n", "at most 256"),
    ({"prompt": "x", "max_tokens": 1, "logit_bias": {str(i): 1.0 for i in range(2000)}}, 400, "logit_bias",
     "--max-logit-bias"),
    ({"prompt": "x", "max_tokens": 1, "logprobs": 21}, 400, "logprobs", "--max-logprobs"),
    ({"prompt": "x", "max_tokens": 1, "prompt_logprobs": 1000}, 400, "prompt_logprobs", "--max-logprobs"),
]


def test_limits_are_400s_naming_the_limit(server: Server, keepalive: httpx.Client) -> None:
    for body, status, field, text in LIMITED:
        r = keepalive.post("/v1/completions", json=body)
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == field and text in err["message"], (field, r.text)
    r = keepalive.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "logprobs": True, "top_logprobs": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    for bias in ("NaN", "Infinity", "-Infinity"):
        r = keepalive.post("/v1/completions", content=f'{{"prompt": "x", "logit_bias": {{"5": {bias}}}}}',
                           headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias"), r.text
    r = keepalive.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Big": "a" * 100_000})
    assert r.status_code == 431 and "--max-header-bytes" in r.json()["error"]["message"], r.text
    server.wait_idle(timeout=10)


def test_api_docs_are_off_by_default(server: Server, keepalive: httpx.Client) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert keepalive.get(path).status_code == 404, path


def test_health_answers_within_100ms_while_heavy_requests_run(server: Server, tmp_path: Path) -> None:
    """/tokenize of a million tokens with their strings, and prompt_logprobs + echo over a long prompt, run while
    another process probes /health every 20 ms (its own process: the test's JSON parsing must not stall it; open
    loop, so a stall of the server's event loop delays every probe sent meanwhile)."""
    stop = tmp_path / "stop"
    poller = subprocess.Popen([sys.executable, "-c", POLL, server.url, str(stop)], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    headers = {"Authorization": f"Bearer {KEY}"}
    text = "hello world " * 500_000

    def tokenize() -> int:
        t = time.monotonic()
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=120)
        print(f"tokenize {time.monotonic() - t:.1f} s")
        return r.status_code if r.status_code != 200 else len(r.content)

    def scored() -> int:
        t = time.monotonic()
        body = {"prompt": list(range(1000, 2000)), "max_tokens": 1, "echo": True, "logprobs": 20,
                "prompt_logprobs": 20}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
        print(f"scored {time.monotonic() - t:.1f} s")
        return r.status_code if r.status_code != 200 else len(r.content)

    start = time.monotonic()
    with ThreadPoolExecutor(2) as ex:
        sizes = [f.result() for f in [ex.submit(tokenize), ex.submit(scored)]]
    took = time.monotonic() - start
    stop.touch()
    out, _ = poller.communicate(timeout=60)
    assert all(s > 1000 for s in sizes), sizes
    lat = sorted(json.loads(out))
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(f"heavy requests {took:.1f} s; /health: {len(lat)} polls, median {lat[len(lat) // 2] * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms")
    assert p99 < 0.1, lat[-10:]


def test_a_light_client_keeps_its_pace_beside_a_heavy_one(tmp_path: Path) -> None:
    """benchmarks/serve/fairness.py, small: a greedy victim's median time per request beside an echo +
    prompt_logprobs neighbour with n = 4 stays within 3x of its time alone."""
    out = tmp_path / "fairness.json"
    cmd = [sys.executable, "-m", "benchmarks.serve.fairness", "--heavy-prompt-len", "1024", "--heavy-n", "4",
           "--victim-requests", "3", "--victim-max-tokens", "8", "--port", str(free_port()), "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    print(run.stdout.strip())
    assert result["heavy_requests_running"] >= 4 and result["ratio"] <= 3.0, result
