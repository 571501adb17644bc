"""A light client's latency beside a heavy one through `hisparse serve`: the fair-scheduling figure.

The victim sends one greedy request at a time (a short prompt, `--victim-max-tokens` tokens); the heavy neighbour
keeps an echo + prompt_logprobs request over a `--heavy-prompt-len` prompt with n = `--heavy-n` in flight. The
script measures the victim's median time per request alone, then with the neighbour running, and prints and
writes their ratio (the goal: at most 3x).

    python -m benchmarks.serve.fairness [--heavy-prompt-len 4096] [--heavy-n 16] [--fair-prefill-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from benchmarks.hisparse_server import start_serve
from hisparse.model.tiny import builtin_tiny

ROOT = Path(__file__).resolve().parents[2]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1000, 131072, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def victim_times(url: str, count: int, prompt_len: int, max_tokens: int) -> list[float]:
    """Seconds per request of `count` sequential greedy requests on one connection."""
    times = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for k in range(count):
            body = {"prompt": ids(prompt_len, k), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            t = time.perf_counter()
            r = c.post("/v1/completions", json=body)
            times.append(time.perf_counter() - t)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens, r.text
    return times


def heavy_neighbour(url: str, prompt_len: int, n: int, stop: threading.Event) -> tuple[threading.Thread,
                                                                                     httpx.Client]:
    """A thread that keeps the heavy request in flight until `stop` (then close the client: the dropped
    connection aborts it in the server)."""
    body = {"prompt": ids(prompt_len, 99), "max_tokens": 1, "echo": True, "logprobs": 5, "prompt_logprobs": 5,
            "n": n}
    client = httpx.Client(base_url=url, timeout=3600)

    def run() -> None:
        while not stop.is_set():
            try:
                client.post("/v1/completions", json=body)
            except (httpx.HTTPError, RuntimeError):   # the client closed under it
                return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, client


def metric(url: str, name: str) -> float:
    """One unlabelled series of /metrics."""
    return next(float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith(name + " "))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heavy-prompt-len", type=int, default=4096)
    ap.add_argument("--heavy-n", type=int, default=16)
    ap.add_argument("--victim-requests", type=int, default=10)
    ap.add_argument("--victim-prompt-len", type=int, default=32)
    ap.add_argument("--victim-max-tokens", type=int, default=16)
    ap.add_argument("--fair-prefill-tokens", type=int, default=128,
                    help="passed to serve (0: FIFO prefill, as before fair scheduling) (default: %(default)s)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--threads", type=int, default=1, help="the server's OMP threads")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serve/fairness.json"))
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    flags = ["--model", str(builtin_tiny()), "--device", "cpu", "--max-model-len", str(args.heavy_prompt_len * 2),
             "--max-num-seqs", str(max(64, args.heavy_n + 1)), "--fair-prefill-tokens", str(args.fair_prefill_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_serve(flags, args.port, args.threads, Path(tmp) / "serve.log")
        try:
            victim_times(url, 2, args.victim_prompt_len, args.victim_max_tokens)   # warm-up
            alone = victim_times(url, args.victim_requests, args.victim_prompt_len, args.victim_max_tokens)
            stop = threading.Event()
            thread, heavy = heavy_neighbour(url, args.heavy_prompt_len, args.heavy_n, stop)
            deadline = time.monotonic() + 60
            while metric(url, "hisparse_num_requests_running") < args.heavy_n and time.monotonic() < deadline:
                time.sleep(0.2)
            heavy_running = metric(url, "hisparse_num_requests_running")
            before, t = metric(url, "hisparse_prompt_tokens_total"), time.monotonic()
            shared = victim_times(url, args.victim_requests, args.victim_prompt_len, args.victim_max_tokens)
            prefilled = metric(url, "hisparse_prompt_tokens_total") - before - args.victim_requests * \
                args.victim_prompt_len
            heavy_rate = prefilled / (time.monotonic() - t)
            stop.set()
            heavy.close()
            thread.join(timeout=60)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    ratio = statistics.median(shared) / statistics.median(alone)
    result = {"benchmark": "victim time per request beside a heavy neighbour, hisparse serve (tiny checkpoint)",
              "command": "python -m benchmarks.serve.fairness " + " ".join(argv if argv is not None else sys.argv[1:]),
              "heavy": {"prompt_len": args.heavy_prompt_len, "n": args.heavy_n, "echo": True, "logprobs": 5,
                        "prompt_logprobs": 5, "max_tokens": 1},
              "victim": {"prompt_len": args.victim_prompt_len, "max_tokens": args.victim_max_tokens,
                         "requests": args.victim_requests},
              "fair_prefill_tokens": args.fair_prefill_tokens, "machine": platform.machine(),
              "server_threads": args.threads, "alone_s": alone, "with_heavy_s": shared,
              "median_alone_s": statistics.median(alone), "median_with_heavy_s": statistics.median(shared),
              "heavy_requests_running": heavy_running, "heavy_prompt_tokens_per_s": heavy_rate,
              "ratio": ratio, "goal": 3.0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"victim median per request: alone {result['median_alone_s']:.3f} s, with the heavy neighbour "
          f"{result['median_with_heavy_s']:.3f} s ({heavy_running:.0f} requests running, {heavy_rate:.0f} of their "
          f"prompt tokens/s): ratio {ratio:.2f}x (goal <= 3x); {out}")


if __name__ == "__main__":
    main()
