"""Long-prompt chunked prefill of the random tiny model through ResidentKV('fp8_ds_mla'): seconds per chunk.

The tiny preset with max_position_embeddings = 2^21, random tokens, chunks of --chunk queries. The run stops after
--tokens tokens or --budget seconds; the time of the remaining chunks up to --target tokens is projected from a
least-squares fit t(chunk) = a + b * context over the measured chunks (the indexer's work per chunk grows
linearly with the context; everything else is flat). Both process CPU seconds and wall seconds are recorded (the
CPU figure is what the run costs on an otherwise idle machine). Optional cProfile of the whole run.

    python -m benchmarks.indexer.prefill [--tokens 1048576] [--chunk 4096] [--budget 3600] [--threads 2]
                                         [--profile /tmp/prefill.prof] [--out benchmarks/results/indexer/prefill.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import time
from pathlib import Path

import torch

from hisparse.core.batch import Segment
from hisparse.core.config import preset_params
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


@torch.no_grad()
def prefill(tokens: int, chunk: int, budget: float, target: int, seed: int = 0) -> dict:
    params = preset_params("tiny")
    params["max_position_embeddings"] = 1 << 21
    model = random_model(params, seed)
    kv = ResidentKV(model.cfg, "fp8_ds_mla")
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    rows, start = [], time.perf_counter()
    for s in range(0, tokens, chunk):
        n = min(chunk, tokens - s)
        c0, w0 = time.process_time(), time.perf_counter()
        model(ids[s:s + n], [Segment(0, s, n)], kv, logits_at=torch.tensor([n - 1]))
        rows.append({"start": s, "length": n, "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0})
        print(f"chunk @{s:>8}: cpu {rows[-1]['cpu_s']:7.2f}s wall {rows[-1]['wall_s']:7.2f}s", flush=True)
        if time.perf_counter() - start > budget:
            break
    done = rows[-1]["start"] + rows[-1]["length"]
    full = [r for r in rows if r["length"] == chunk]
    out = {"tokens_run": done, "chunks": rows,
           "measured_cpu_s": sum(r["cpu_s"] for r in rows), "measured_wall_s": sum(r["wall_s"] for r in rows)}
    for key in ("cpu_s", "wall_s"):
        a, b = fit([r["start"] for r in full], [r[key] for r in full])
        rest = sum(a + b * s for s in range(done, target, chunk))
        out[f"projected_{target}_{key}"] = out[f"measured_{key}"] + rest
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--target", type=int, default=1 << 20, help="prompt length the projection is for")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=3600.0, help="stop after this many wall seconds")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--profile", default=None, help="write a cProfile of the run here")
    ap.add_argument("--out", default="benchmarks/results/indexer/prefill.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prof = cProfile.Profile(time.process_time) if args.profile else None   # CPU seconds: robust to a busy machine
    if prof:
        prof.enable()
    res = prefill(args.tokens, args.chunk, args.budget, args.target)
    if prof:
        prof.disable()
        Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(args.profile)
    res["setup"] = {"model": "random tiny preset, seed 0, max_position_embeddings 2^21", "kv": "ResidentKV fp8_ds_mla",
                    "chunk": args.chunk, "threads": args.threads, "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "chunks"}, indent=2))


if __name__ == "__main__":
    main()
