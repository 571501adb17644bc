"""One client's request cannot hurt the server: a real `hisparse serve` process driven over HTTP with requests
that are rejected part-way, malformed in ways the validators miss, oversized in fan-out, or heavy, while other
requests (on the same keep-alive connection, or beside them) must keep working."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import KEY, MAX_MODEL_LEN, Server, launch


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch(tmp_path_factory.mktemp("logs") / "serve.log") as s:
        yield s


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    """One keep-alive connection to the server."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      limits=httpx.Limits(max_connections=1)) as c:
        yield c


def running(server: Server) -> float:
    return server.metrics()["hisparse_num_requests_running"] + server.metrics()["hisparse_num_requests_waiting"]


def test_a_rejected_batch_leaves_nothing_running(server: Server, http: httpx.Client) -> None:
    """The second prompt is too long: the whole request is a 400 and none of the first prompt's choices run."""
    budget = MAX_MODEL_LEN - 8
    r = http.post("/v1/completions", json={"prompt": [[1, 2, 3], [1] * (MAX_MODEL_LEN - 4)], "max_tokens": budget,
                                           "n": 4, "ignore_eos": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    time.sleep(0.5)   # several engine steps
    m = server.metrics()
    assert m["hisparse_num_requests_running"] == 0 and m["hisparse_kv_reserved_tokens"] == 0, m
    server.wait_idle(timeout=5)
