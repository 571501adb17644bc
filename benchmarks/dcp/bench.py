"""DCP benchmark: host-pool capacity in tokens and decode step time vs the DCP size R (`small` preset).

Every rank is a real process (gloo) with its own HiSparseKV host pool of --pool-gib. Capacity: for two seeded
streams of requests (lengths uniform in [64, 4096] and in [4096, 65536]), every request that still fits is admitted
through the rank's ShardedKV.reserve (each rank takes the same decisions: it reserves the most loaded rank's
share), then every admitted request's pages are allocated on every rank (begin_step), which must not exhaust any
pool. Reported: the nominal capacity (R x one pool), the admitted tokens, and capacity(R) / (R capacity(1)) for
both. Step time: one request is prefilled to --context tokens, then --steps greedy decode steps are timed (median
and fastest wall and process CPU time per step, every rank); R = 1 also runs the plain single-rank path, for the
cost of the DCP hooks themselves. The greedy tokens of every R must equal R = 1's. Results -> JSON.

    python -m benchmarks.dcp.bench [--sizes 1,2,4] [--interleave 1] [--pool-gib 0.5] [--context 4096]
                                   [--steps 32] [--threads 1] [--out benchmarks/results/dcp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from hisparse.parallel.context import DCPContext
from hisparse.parallel.group import RankGroup
from hisparse.parallel.sharded_kv import ShardedKV
from hisparse.parallel.launch import launch
from hisparse.engine.generate import prefill
from hisparse.kv.settings import KVSettings
from hisparse.core.batch import Segment
from hisparse.core.config import preset_params
from hisparse.kv.base import LatentKV
from hisparse.model.tiny import random_model

MIXES = {"short": (64, 4096), "long": (4096, 65536)}   # request lengths, uniform in [lo, hi]


def capacity(kv: ShardedKV, lengths: tuple[int, int], n_requests: int = 20_000) -> dict:
    """Admit a seeded stream of requests through this rank's store (every one that still fits, in order), then
    allocate every admitted request's pages on this rank's pool (must not exhaust it)."""
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(lengths[0], lengths[1] + 1, (n_requests,), generator=g).tolist()
    admitted = []
    for i, n in enumerate(stream):
        if kv.tokens_unreserved() < lengths[0]:
            break
        if kv.reserve(("cap", i), n):
            admitted.append((("cap", i), n))
    for req, n in admitted:                     # real page allocation of every admitted token on this rank
        kv.begin_step([Segment(req, 0, n)])
        kv.end_step()
    pool = kv.inner.pool
    out = {"nominal_tokens": kv.token_capacity(), "admitted_requests": len(admitted),
           "admitted_tokens": sum(n for _, n in admitted), "rank_pool_tokens": pool.token_capacity,
           "rank_pool_bytes": pool.nbytes, "rank_pages_used": pool.pages_used, "rank_pages": pool.n_pages}
    for req, _ in admitted:
        kv.release(req)
    return out


def decode_steps(model, kv: LatentKV, context: int, steps: int) -> dict:
    """Prefill one request to `context` tokens; time `steps` greedy decode steps (wall and this process's CPU)."""
    prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = prefill(model, kv, "d", prompt, chunk=1024)
    wall, cpu, tokens = [], [], []
    for i in range(steps):
        tok = int(logits.argmax())
        tokens.append(tok)
        t, c = time.perf_counter(), time.process_time()
        logits = model(torch.tensor([tok]), [Segment("d", context + i, 1)], kv)[0]
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    kv.release("d")
    return {"step_wall_s": statistics.median(wall), "step_cpu_s": statistics.median(cpu),
            "step_wall_min_s": min(wall), "step_cpu_min_s": min(cpu), "tokens": tokens,
            "misses": kv.stats.misses, "hits": kv.stats.hits}


def rank_main(group: RankGroup, args: dict) -> dict:
    model = random_model(preset_params("small"), seed=0)

    def store() -> LatentKV:
        return KVSettings(offload="hisparse", host_pool_gib=args["pool_gib"]).build(model.cfg)

    dcp = DCPContext(group, args["interleave"])
    out = {"capacity": {mix: capacity(ShardedKV(store(), dcp), lengths) for mix, lengths in MIXES.items()},
           "decode": decode_steps(model, ShardedKV(store(), dcp), args["context"], args["steps"])}
    if group.size == 1:
        out["plain_decode"] = decode_steps(model, store(), args["context"], args["steps"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--pool-gib", type=float, default=0.5)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/dcp.json")
    args = ap.parse_args()
    params = {"pool_gib": args.pool_gib, "interleave": args.interleave, "context": args.context, "steps": args.steps}
    runs = {}
    for size in [int(s) for s in args.sizes.split(",")]:
        t = time.perf_counter()
        ranks = launch(rank_main, size, params, threads=args.threads, timeout_s=600.0)
        runs[size] = {"ranks": ranks, "run_s": time.perf_counter() - t}
        print(f"R={size}: {ranks[0]['capacity']['long']['admitted_tokens']} tokens admitted (long mix), "
              f"step {ranks[0]['decode']['step_wall_s'] * 1e3:.1f} ms wall", flush=True)
    base = runs[min(runs)]["ranks"][0]
    rows = []
    for size, run in runs.items():
        r0 = run["ranks"][0]
        dec = r0["decode"]
        if dec["tokens"] != base["decode"]["tokens"]:
            raise SystemExit(f"R={size}: greedy tokens differ from R={min(runs)}")
        row = {"R": size, "interleave": args.interleave,
               "nominal_capacity_tokens": r0["capacity"]["short"]["nominal_tokens"],
               "nominal_ratio": r0["capacity"]["short"]["nominal_tokens"]
               / (size * base["capacity"]["short"]["nominal_tokens"])}
        for mix in MIXES:
            cap, cap1 = r0["capacity"][mix], base["capacity"][mix]
            row[mix] = {"admitted_tokens": cap["admitted_tokens"], "admitted_requests": cap["admitted_requests"],
                        "admitted_over_nominal": cap["admitted_tokens"] / cap["nominal_tokens"],
                        "capacity_ratio": cap["admitted_tokens"] / (size * cap1["admitted_tokens"]),
                        "pages_used_per_rank": [r["capacity"][mix]["rank_pages_used"] for r in run["ranks"]]}
        row.update({
            "pages_per_rank": r0["capacity"]["short"]["rank_pages"],
            "pool_bytes_per_rank": r0["capacity"]["short"]["rank_pool_bytes"],
            "step_wall_ms": 1e3 * dec["step_wall_s"], "step_cpu_ms_rank0": 1e3 * dec["step_cpu_s"],
            "step_cpu_ms_per_rank": [1e3 * r["decode"]["step_cpu_s"] for r in run["ranks"]],
            "step_wall_min_ms": 1e3 * dec["step_wall_min_s"],
            "step_cpu_min_ms_per_rank": [1e3 * r["decode"]["step_cpu_min_s"] for r in run["ranks"]],
            "misses_per_rank": [r["decode"]["misses"] for r in run["ranks"]], "run_s": run["run_s"]})
        if "plain_decode" in r0:
            plain = r0["plain_decode"]
            row.update({"plain_step_wall_ms": 1e3 * plain["step_wall_s"], "plain_step_wall_min_ms":
                        1e3 * plain["step_wall_min_s"], "plain_step_cpu_ms": 1e3 * plain["step_cpu_s"],
                        "plain_step_cpu_min_ms": 1e3 * plain["step_cpu_min_s"]})
        rows.append(row)
    res = {"preset": "small", "layout": "fp8_ds_mla", "pool_gib_per_rank": args.pool_gib, "context": args.context,
           "decode_steps": args.steps, "threads_per_rank": args.threads, "request_length_mixes": MIXES,
           "goal": "capacity_ratio >= 0.95", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                        "loadavg_at_end": os.getloadavg()},
           "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
