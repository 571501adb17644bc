"""Prefill progress of a needle run, read from the servers: a million-token request answers after many minutes, so
the harness polls each endpoint's Prometheus `/metrics` for its prompt-token counter and shows one bar per
endpoint (tokens prefilled of the tokens it has to prefill) with an ETA from t(p) = a p + b p^2, fitted to the
seconds each request took to reach p tokens (the indexer makes prefill quadratic in the context)."""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

# the prompt-token counters of `hisparse serve` (counted per prefill chunk) and of vLLM
COUNTERS = ("hisparse_prompt_tokens_total", "vllm:prompt_tokens_total")


def fit_quadratic(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) >= 0 of t(p) = a p + b p^2 by least squares, or None before there are three points."""
    if len(points) < 3:
        return None
    p, t = np.array(points, dtype=np.float64).T
    (a, b), *_ = np.linalg.lstsq(np.stack((p, p * p), axis=1), t, rcond=None)
    if b < 0:     # no measurable quadratic part yet: linear fit
        return float(p @ t / (p @ p)), 0.0
    if a < 0:
        return 0.0, float((p * p) @ t / ((p * p) @ (p * p)))
    return float(a), float(b)


def fmt_s(s: float | None) -> str:
    """h:mm:ss, or ? when unknown."""
    if s is None:
        return "?"
    s = max(0, int(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def metrics_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port/metrics (both servers serve the OpenAI API under /v1)."""
    return re.sub(r"/v1/?$", "", base_url.rstrip("/")) + "/metrics"


def prompt_tokens(text: str) -> float | None:
    """The prompt-token counter in a Prometheus text exposition (the sum over its label sets), or None."""
    for name in COUNTERS:
        values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        if values:
            return sum(values)
    return None


@dataclass
class _Lane:
    """One endpoint: its counter at the start, its queue of request lengths, and the request in flight."""
    url: str
    bar: tqdm
    queued: list[int]
    start_count: float | None = None
    current: tuple[int, float, float] | None = None     # (tokens, counter at its start, its start time)
    points: list[tuple[int, float]] = field(default_factory=list)


class PrefillWatch:
    """Polls every `every_s` seconds in a daemon thread; the harness calls `begin`/`end` around each request
    (the per-request ETA needs one request in flight per endpoint; with more, the bars show tokens only). An
    endpoint without a prompt-token counter keeps a bar that does not move."""

    def __init__(self, lanes: dict[str, tuple[str, list[int]]], every_s: float = 5.0, per_request_eta: bool = True):
        self.every_s, self.per_request_eta = every_s, per_request_eta
        self.lock = threading.Lock()
        self.lanes = {name: _Lane(metrics_url(url), tqdm(total=sum(tokens), unit="tok", unit_scale=True,
                                                         desc=f"prefill {name}", leave=False), list(tokens))
                      for name, (url, tokens) in lanes.items()}
        for lane in self.lanes.values():
            lane.start_count = self._read(lane)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _read(self, lane: _Lane) -> float | None:
        try:
            with urllib.request.urlopen(lane.url, timeout=5) as r:
                return prompt_tokens(r.read().decode())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def begin(self, name: str, tokens: int) -> None:
        """A request of `tokens` prompt tokens was sent to endpoint `name`."""
        lane = self.lanes[name]
        count = self._read(lane)
        with self.lock:
            if tokens in lane.queued:
                lane.queued.remove(tokens)
            lane.current = None if count is None else (tokens, count, time.perf_counter())

    def end(self, name: str) -> None:
        """Endpoint `name` answered its request."""
        lane = self.lanes[name]
        with self.lock:
            if lane.current is not None:
                tokens, _, t0 = lane.current
                lane.points.append((tokens, time.perf_counter() - t0))
            lane.current = None
        self.poll(name)

    def eta(self, name: str, done: int) -> float | None:
        """Seconds until endpoint `name` has prefilled every queued request, `done` tokens into the current."""
        lane = self.lanes[name]
        ab = fit_quadratic(lane.points)
        if ab is None or not self.per_request_eta:
            return None
        t = lambda p: ab[0] * p + ab[1] * p * p   # noqa: E731
        left = sum(t(n) for n in lane.queued)
        if lane.current is not None:
            left += max(0.0, t(lane.current[0]) - t(done))
        return left

    def poll(self, name: str) -> None:
        """Read endpoint `name`'s counter and move its bar."""
        lane = self.lanes[name]
        count = self._read(lane)
        if count is None or lane.start_count is None:
            return
        with self.lock:
            done = 0
            if lane.current is not None:
                tokens, c0, t0 = lane.current
                done = int(min(tokens, count - c0))
                if done > 0:
                    lane.points.append((done, time.perf_counter() - t0))
            lane.bar.n = min(lane.bar.total, int(count - lane.start_count))
            lane.bar.set_postfix_str(f"eta {fmt_s(self.eta(name, done))}", refresh=False)
            lane.bar.refresh()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            for name in self.lanes:
                self.poll(name)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for lane in self.lanes.values():
            lane.bar.close()
