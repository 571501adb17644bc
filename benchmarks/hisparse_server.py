"""`hisparse serve` as a benchmark starts it: a subprocess with its own thread count, waited for until /health
answers (its log in the error when it exits or does not start within 300 s); `wait_healthy` for any server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_serve(flags: list[str], port: int, threads: int, log: Path) -> subprocess.Popen:
    """`hisparse serve --port PORT --log-level warning FLAGS...`, once healthy."""
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return wait_healthy(proc, port, log, "hisparse serve", 300)


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, name: str, timeout_s: float) -> subprocess.Popen:
    """proc once http://127.0.0.1:PORT/health answers 200; SystemExit with its log's tail if it exits first or
    does not answer within timeout_s (then it is killed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{name} did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
