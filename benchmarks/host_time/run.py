"""Host time of one decode step against requests and layers: what the engine's Python costs when the model's
layers are nearly free (the `tiny` preset, dim 64, at one CPU thread; deeper variants repeat its 8-layer pattern).

For every layer count L and request count R, R requests with 32-token prompts are prefilled, then `--steps`
decode steps are timed (mean wall time per step), eager and through the full-step graphs' static step. On the CPU
the static step's function runs eagerly; a GPU replays it in one call, so the step's host time is its wall time
minus the time inside that function (`host`): the store's begin_step, the one input copy and end_step_host. The
slope per request (ms per added request) is printed per L: host work that grows with requests x layers shows as
a slope that grows with L. Writes JSON and a PNG.

    python -m benchmarks.host_time.run [--layers 8,16,32] [--requests 1,4,16,64] [--offload hisparse]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hisparse.core.config import preset_params
from hisparse.engine.engine import Engine
from hisparse.engine.full_graph import FullGraphs, StepGraph
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.kv.settings import KVSettings
from hisparse.model.tiny import random_model

PROMPT = 32


def deep_tiny(layers: int) -> dict:
    """The tiny preset's 8-layer pattern repeated to `layers` layers (each copy's sources point into itself)."""
    p, reps = preset_params("tiny"), layers // 8
    p["n_layers"] = layers
    p["no_rope_layers"] = p["no_rope_layers"] * reps
    for key in ("kv_source_layers", "index_source_layers"):
        p[key] = [s + 8 * i for i in range(reps) for s in p[key]]
    return p


def step_ms(model, settings: KVSettings, requests: int, steps: int, full: bool) -> tuple[float, float]:
    """Mean wall time (ms) of a pure decode step of `requests` requests, and of it the time outside the
    full-step function (0 when eager)."""
    kv = settings.build(model.cfg)
    graphs = FullGraphs(model, kv, requests) if full else None
    eng = Engine(model, kv, SchedulerConfig(max_model_len=PROMPT + steps + 8, max_num_seqs=requests,
                                            max_num_batched_tokens=max(PROMPT * requests, 64)), graphs=graphs)
    g = torch.Generator().manual_seed(0)
    for _ in range(requests):
        eng.add_request(torch.randint(0, model.cfg.vocab_size, (PROMPT,), generator=g).tolist(),
                        SamplingParams(max_tokens=steps + 4, temperature=0.0))
    while not ((st := eng.step()).prompt_tokens == 0 and st.generation_tokens):     # prefill everything
        pass
    eng.step()
    inside, body = [0.0], StepGraph.body

    def timed(self, views):
        t = time.perf_counter()
        out = body(self, views)
        inside[0] += time.perf_counter() - t
        return out
    StepGraph.body = timed
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t0
    finally:
        StepGraph.body = body
    return wall / steps * 1e3, ((wall - inside[0]) / steps * 1e3 if full else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,16,32")
    ap.add_argument("--requests", default="1,4,16,64")
    ap.add_argument("--offload", default="hisparse", choices=["none", "hisparse", "hybrid"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/host_time")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers, requests = [int(x) for x in args.layers.split(",")], [int(x) for x in args.requests.split(",")]
    settings = KVSettings(offload=args.offload, host_pool_gib=0.05, page_tokens=16, device_kv_gib=0.01)
    rows = []
    with tqdm(total=len(layers) * len(requests) * 2, desc="host time") as bar:
        for L in layers:
            model = random_model(deep_tiny(L), seed=0)
            for R in requests:
                for full in (False, True):
                    ms, host = step_ms(model, settings, R, args.steps, full)
                    rows.append({"layers": L, "requests": R, "step": "full" if full else "eager", "ms": ms})
                    if full:
                        rows.append({"layers": L, "requests": R, "step": "full_host", "ms": host})
                    bar.update()
    summary = {}
    for step in ("eager", "full", "full_host"):
        for L in layers:
            ms = {r["requests"]: r["ms"] for r in rows if r["layers"] == L and r["step"] == step}
            lo, hi = min(requests), max(requests)
            summary[f"{step}_L{L}_ms_per_request"] = (ms[hi] - ms[lo]) / (hi - lo)
            summary[f"{step}_L{L}_ms_at_{lo}"] = ms[lo]
    for r in rows:
        print(f"L={r['layers']:3d} R={r['requests']:3d} {r['step']:9s} {r['ms']:8.2f} ms/step")
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_time.json").write_text(json.dumps(
        {"command": "python -m benchmarks.host_time.run " + " ".join(f"--{k} {v}" for k, v in (
            ("layers", args.layers), ("requests", args.requests), ("offload", args.offload), ("steps", args.steps))),
         "machine": platform.processor() or platform.machine(), "threads": 1, "offload": args.offload,
         "rows": rows, "summary": summary}, indent=2) + "\n")
    plot(rows, layers, out / "host_time.png")


def plot(rows: list[dict], layers: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for step, style in (("eager", "--"), ("full", ":"), ("full_host", "-")):
        for L in layers:
            pts = sorted((r["requests"], r["ms"]) for r in rows if r["layers"] == L and r["step"] == step)
            ax.plot(*zip(*pts), style, marker="o", label=f"{step}, {L} layers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in the decode step")
    ax.set_ylabel("ms per step (1 thread)")
    ax.set_title("Decode step time, tiny-pattern model (layers nearly free)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
