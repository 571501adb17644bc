"""Helpers for tests that run a real server subprocess: a free loopback port, the wait for /health, and `hisparse
serve` on the built-in tiny checkpoint (`launch`, the module-scoped `server` fixture and its `tok` and `reference`
fixtures, which a test module imports to use), with its API key and random prompts."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hisparse.engine.generate import greedy_generate
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import builtin_tiny
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180) -> None:
    """Poll `url`/health until it answers 200; fail with the server log if it exits or never comes up."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server did not start:\n{log.read_text()}"
        time.sleep(0.3)


@contextmanager
def running(cmd: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """Run `cmd` with output to `log` for the duration of the block; terminate (then kill) it afterwards."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


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
           "--api-key", KEY, "--debug-hooks", "--max-model-len", str(MAX_MODEL_LEN), "--kv-offload", "hisparse",
           "--host-pool-gib", "0.05",
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
