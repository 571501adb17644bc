"""Helpers for tests that run a real server subprocess: a free loopback port and the wait for /health."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
import subprocess
import time
from pathlib import Path

import httpx


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
