"""Where a batched decode step spends its time: py-spy samples of pure decode steps, by code area.

Prefills C requests (small preset, HiSparse on), then attaches py-spy to this process while it runs decode steps,
and attributes every sample to the innermost hisparse frame's area:
  working set   hisparse/gpu_working_set/*, hisparse/host_pool/* (but the row codec), hisparse/kv/* (but sparse_mla
                and scoring) and hisparse/parallel/sharded_kv.py: resolving, copying and addressing rows, LRU, pages
  row codec     hisparse/host_pool/layout.py: packing rows to fp8_ds_mla / bf16 bytes and unpacking them
  indexer       hisparse/model/indexer.py, hisparse/kv/scoring.py and their kernels (scoring + exact top-k)
  attention     sparse_mla (the absorbed MQA over the gathered rows)
  model         the rest of hisparse/model (projections, MoE, norms, rope)
  engine        scheduler, sampling, request bookkeeping (hisparse/engine, outside the forward)
Writes JSON (shares, sample counts) next to the raw py-spy profile; with --compare (another run's JSON, e.g. of an
older checkout) also a PNG of both steps' time by area.

    python -m benchmarks.throughput.profile [--concurrency 16] [--prompt-len 1024] [--seconds 20] [--compare J]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from hisparse.engine.engine import Engine
from hisparse.kv.settings import KVSettings
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.core.config import preset_params
from hisparse.model.tiny import random_model

from .run import pyplot

AREAS = ("working set", "row codec", "indexer", "attention", "model", "engine", "other")


def area_of(frame: str) -> str | None:
    """The code area of one py-spy frame `function (path:line)`, or None outside hisparse."""
    name, _, where = frame.rpartition(" (")
    path = where.split(":")[0]
    if "hisparse/" not in path:
        return None
    rel = path[path.index("hisparse/"):]
    if name == "sparse_mla":
        return "attention"
    if rel == "hisparse/host_pool/layout.py":
        return "row codec"
    if rel.startswith(("hisparse/model/indexer.py", "hisparse/model/kernels/", "hisparse/kv/scoring.py",
                       "hisparse/kv/kernels/")):
        return "indexer"
    if rel.startswith(("hisparse/gpu_working_set/", "hisparse/host_pool/", "hisparse/kv/",
                       "hisparse/parallel/sharded_kv.py")):
        return "working set"
    if rel.startswith("hisparse/model/"):
        return "model"
    if rel.startswith("hisparse/engine/"):
        return "engine"
    return "other"


def summarize(raw: Path) -> dict:
    """Samples per area from a py-spy raw profile (`frame;frame;... count` per line, outermost first)."""
    samples: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        areas = [a for a in (area_of(f) for f in stack.split(";")) if a is not None]
        samples[areas[-1] if areas else "other"] += int(count)
    total = sum(samples.values())
    return {"samples": total, "share": {a: samples[a] / total for a in AREAS if total}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=20.0, help="decode time sampled")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/throughput/profile")
    ap.add_argument("--compare", default=None, help="profile.json of another run, plotted as 'before'")
    args = ap.parse_args()
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if py_spy is None:
        raise SystemExit("profile needs py-spy (the bench extra: pip install -e '.[bench]')")
    torch.set_num_threads(args.threads)
    model = random_model(preset_params(args.preset), 0)
    kv = KVSettings(offload="hisparse", host_pool_gib=1.0).build(model.cfg)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=args.prompt_len + 4096,
                                               max_num_seqs=args.concurrency, max_num_batched_tokens=2048))
    g = torch.Generator().manual_seed(0)
    for _ in range(args.concurrency):
        engine.add_request(torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist(),
                           SamplingParams(max_tokens=4096, temperature=0.0))
    while True:                   # prefill every request, then one warm-up decode step
        st = engine.step()
        if st.prompt_tokens == 0 and st.num_running == args.concurrency:
            break
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "pyspy_raw.txt"
    spy = subprocess.Popen([py_spy, "record", "--pid", str(os.getpid()), "--rate", str(args.rate), "--format", "raw",
                            "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)               # py-spy attaches
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        engine.step()
        steps += 1
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    result = {"benchmark": "py-spy profile of pure decode steps", "preset": args.preset,
              "concurrency": args.concurrency, "prompt_len": args.prompt_len, "decode_steps": steps,
              "step_ms": step_ms, "threads": args.threads, **summarize(raw)}
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if args.compare:
        plot([("before", json.loads(Path(args.compare).read_text())), ("after", result)], out / "profile.png")


def plot(runs: list[tuple[str, dict]], path: Path) -> None:
    """Stacked bars: each run's decode step time split by area."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{name}\n{r['step_ms']:.0f} ms/step" for name, r in runs]
    bottom = [0.0] * len(runs)
    for area in AREAS:
        ms = [r["step_ms"] * r["share"].get(area, 0.0) for _, r in runs]
        ax.bar(labels, ms, bottom=bottom, label=area)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_ylabel("ms per decode step")
    r = runs[-1][1]
    ax.set_title(f"{r['concurrency']} requests, {r['prompt_len']}-token prompts, {r['preset']} preset (py-spy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
