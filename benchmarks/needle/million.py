"""The million-token run: one request of a 1,048,576-token needle prompt, chunked prefill, 32 greedy tokens,
served by the engine of `hisparse serve` with HiSparse KV on this machine's CPU.

    python -m benchmarks.needle.million [--model DIR] [--tokens 1048576] [--decode 32] [--chunk 4096] \\
        [--threads 1] [--haystack corpus|synthetic] [--seed 0] [--depth 50] [--indexer-build default|bf16|fma] \\
        [--out benchmarks/results/needle/million.json]

It drives the serving engine (`hisparse.engine.Engine`: scheduler, chunked prefill, sampler, HiSparseKV)
in-process rather than over HTTP, so that prefill and decode are timed apart at the step where the first token
is sampled, and the request's device-side bytes (`HiSparseKV.device_bytes`) can be read while it runs. The
host pool is sized to hold exactly the request (prompt + decode, whole pages).

The prompt is a needle haystack (benchmarks.needle.prompt, the completions form, the needle at `--depth`) of
exactly `--tokens` tokens by the checkpoint's tokenizer: English prose (`corpus`), or the passkey model's training
distribution (`synthetic`: the prompt `python -m benchmarks.needle --haystack synthetic` sends for that seed). While prefill runs, a progress bar shows the tokens done
and an ETA from a fit t(p) = a p + b p^2 of the elapsed time (the indexer makes prefill quadratic), and the
progress, fit and projected prefill time for 1,048,576 tokens are written to `<out>.progress.json` every few
seconds. The final JSON has the wall times, peak RSS, host-pool bytes, the request's device bytes and the
HiSparse hit/miss counters of each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from hisparse.engine.engine import Engine
from hisparse.kv.settings import KVSettings, KVSettingsError
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.host_pool.pool import GIB
from hisparse.kv.geometry import row_layout
from hisparse.kv.kernels import indexer_topk
from hisparse.kv.base import KVStats
from hisparse.model.tiny import builtin_tiny
from hisparse.model.weights import load_model
from hisparse.train.passkey import SyntheticHaystack

from .corpus import Corpus
from .harness import needle_value, retrieved
from .prompt import PromptBuilder
from .tokens import LocalCounter
from .watch import fit_quadratic, fmt_s

MILLION = 1 << 20
# kernel builds an A/B run can pick: the default (AMX tiles, else the int8 or bf16 dot filter, else FMA), the bf16
# dot filter (VDPBF16PS) where the CPU has it, and the FMA filter alone
INDEXER_BUILDS = {"default": indexer_topk.Build(), "bf16": indexer_topk.DOT_BF16_FILTER, "fma": indexer_topk.FMA_FILTER}
PROGRESS_EVERY_S = 10.0


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pool_gib(cfg, settings: KVSettings, tokens: int) -> float:
    """Host pool size (GiB) that holds `tokens` positions in whole pages of `settings`, with half a page of slack
    for the float round trip."""
    page = settings.page_tokens
    page_bytes = page * row_layout(cfg, settings.layout).row_bytes * len(cfg.kv_owner_layers)
    return (-(-tokens // page) + 0.5) * page_bytes / GIB


class PrefillClock:
    """Wall and process-CPU seconds of prefill vs tokens done, each fitted by t(p) = a p + b p^2 (the ETA, and
    the projection to other lengths). CPU seconds are what the run would take alone on the machine with one
    thread; wall seconds include whatever else runs there."""

    def __init__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.wall: list[tuple[int, float]] = []
        self.cpu: list[tuple[int, float]] = []

    def add(self, done: int) -> float:
        elapsed = time.perf_counter() - self.t0
        self.wall.append((done, elapsed))
        self.cpu.append((done, time.process_time() - self.c0))
        return elapsed

    def projected(self, tokens: int) -> dict[str, float | None]:
        """Fitted prefill seconds (wall and CPU) for `tokens`."""
        out = {}
        for name, pts in (("wall_s", self.wall), ("cpu_s", self.cpu)):
            ab = fit_quadratic(pts)
            out[name] = None if ab is None else round(ab[0] * tokens + ab[1] * tokens * tokens, 1)
        return out


def write_json(path: Path, data: dict) -> None:
    """Atomic write (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def stats_delta(a: KVStats, b: KVStats) -> dict:
    return {"hits": b.hits - a.hits, "misses": b.misses - a.misses,
            "host_to_device_bytes": b.host_to_device_bytes - a.host_to_device_bytes,
            "device_to_host_bytes": b.device_to_host_bytes - a.device_to_host_bytes,
            "overlapped_copies": b.overlapped_copies - a.overlapped_copies, "steps": b.steps - a.steps}


def git_commit() -> str | None:
    """HEAD, with -dirty when the working tree has changes."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(args: argparse.Namespace, settings: KVSettings) -> dict:
    """The run of `args`, on a HiSparse store of `settings` whose host pool is sized to the request."""
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    progress_path = out.with_suffix(".progress.json")
    model_dir = Path(args.model) if args.model else builtin_tiny()
    model = load_model(model_dir)
    cfg = model.cfg
    rss_model = rss_bytes()

    t = time.perf_counter()
    counter = LocalCounter(model_dir)
    depth = args.depth / 100
    value = needle_value(args.seed, args.tokens, depth)
    haystack = Corpus() if args.haystack == "corpus" else SyntheticHaystack(args.seed)
    prompt = PromptBuilder(haystack, counter, "completions").build(args.tokens, depth, value)
    ids = counter.encode("completions", prompt.content)
    if len(ids) != args.tokens:
        raise SystemExit(f"--tokens: the prompt builder met {len(ids)} tokens, not {args.tokens}")
    build_s = time.perf_counter() - t

    total = args.tokens + args.decode
    gib = pool_gib(cfg, settings, total)
    kv = replace(settings, host_pool_gib=gib).build(cfg)
    engine = Engine(model, kv, SchedulerConfig(total, max_num_seqs=1, max_num_batched_tokens=args.chunk))
    req = engine.add_request(ids, SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True))
    rss_start = rss_bytes()
    result = {
        "benchmark": "million", "driver": "in-process hisparse.engine.Engine (the engine `hisparse serve` runs)",
        "model": str(model_dir), "prompt_tokens": args.tokens, "decode_tokens": args.decode,
        "chunk": args.chunk, "threads": args.threads, "kv_layout": settings.layout,
        "max_position_embeddings": cfg.max_position_embeddings,
        "indexer_kernel": "fused C++ (hisparse/kv/kernels)" if indexer_topk.available() else "torch",
        "indexer_build": args.indexer_build,
        # what that build runs here: "bf16" is the FMA filter on a CPU without AVX512_BF16
        "indexer_filter": indexer_topk.full_row_filter(INDEXER_BUILDS[args.indexer_build]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "commit": git_commit()},
        "needle": {"value": value, "depth": prompt.needle_depth, "haystack": args.haystack, "seed": args.seed},
        "prompt_build_s": round(build_s, 1),
        "rss_after_model_load_bytes": rss_model, "rss_before_request_bytes": rss_start,
        "host_pool": {"gib": gib, "allocated_bytes": kv.pool.nbytes, "capacity_tokens": kv.token_capacity()},
    }

    clock = PrefillClock()
    s0 = kv.stats.snapshot()
    last_write = 0.0
    bar = tqdm(total=args.tokens, unit="tok", unit_scale=True, desc="prefill",
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
    while not req.output:
        before = req.num_computed
        engine.step()
        if req.finish_reason is not None:
            raise RuntimeError(f"prefill failed at token {before:,}: {req.finish_reason}")
        done = min(req.num_computed, args.tokens)
        elapsed = clock.add(done)
        bar.update(done - before)
        total_s = clock.projected(args.tokens)["wall_s"]
        eta = None if total_s is None else total_s - elapsed
        bar.set_postfix_str(f"eta {fmt_s(eta)} (quadratic fit)", refresh=False)
        if elapsed - last_write >= PROGRESS_EVERY_S or req.output:
            last_write = elapsed
            write_json(progress_path, {
                "phase": "prefill", "tokens_done": done, "tokens": args.tokens, "elapsed_s": round(elapsed, 1),
                "cpu_s": round(clock.cpu[-1][1], 1), "eta_s": None if eta is None else round(eta, 1),
                "projected_prefill": {str(n): clock.projected(n) for n in (args.tokens, MILLION)},
                "rss_bytes": rss_bytes(), "points_wall_cpu": [(p, w, c) for (p, w), (_, c) in
                                                              zip(clock.wall, clock.cpu)]})
    bar.close()
    prefill_s, prefill_cpu_s = time.perf_counter() - clock.t0, time.process_time() - clock.c0
    s1 = kv.stats.snapshot()
    device_prefill = kv.device_bytes(req.id)
    pool_used = kv.pool.pages_used * kv.pool.page_bytes

    t, c = time.perf_counter(), time.process_time()
    device_decode = device_prefill
    for _ in tqdm(range(args.decode - 1), desc="decode", unit="tok"):
        engine.step()
        if req.finish_reason is None:
            device_decode = kv.device_bytes(req.id)
    decode_s, decode_cpu_s = time.perf_counter() - t, time.process_time() - c
    if req.finish_reason != "length" or len(req.output) != args.decode:
        raise RuntimeError(f"request ended with {req.finish_reason!r} after {len(req.output)} tokens")
    s2 = kv.stats.snapshot()
    text = counter.text.decode(req.output)

    result.update({
        "prefill_s": round(prefill_s, 1), "prefill_cpu_s": round(prefill_cpu_s, 1),
        "prefill_tokens_per_s": round(args.tokens / prefill_s, 1), "time_to_first_token_s": round(prefill_s, 1),
        "decode_s": round(decode_s, 2), "decode_cpu_s": round(decode_cpu_s, 2), "decode_steps": args.decode - 1,
        "decode_s_per_token": round(decode_s / max(1, args.decode - 1), 3),
        "load_average_1_5_15": os.getloadavg(),
        "projected_prefill": {str(n): clock.projected(n) for n in (args.tokens, MILLION)},
        "prefill_points_tokens_wall_cpu": [(p, round(w, 2), round(c, 2)) for (p, w), (_, c) in
                                           zip(clock.wall, clock.cpu)],
        "peak_rss_bytes": peak_rss_bytes(),
        "host_pool_used_bytes": pool_used,
        "device_bytes_end_of_prefill": device_prefill, "device_bytes_last_decode_step": device_decode,
        "hisparse_prefill": stats_delta(s0, s1), "hisparse_decode": stats_delta(s1, s2),
        "output_ids": req.output, "output_text": text, "needle_retrieved": retrieved(value, text),
    })
    write_json(out, result)
    write_json(progress_path, {"phase": "done", "tokens_done": args.tokens, "tokens": args.tokens,
                               "elapsed_s": round(prefill_s + decode_s, 1), "result": str(out)})
    gib_of = lambda b: f"{b / GIB:.2f} GiB"   # noqa: E731
    print(f"million: {args.tokens:,}-token prompt prefilled in {fmt_s(prefill_s)} ({args.tokens / prefill_s:,.0f} "
          f"tok/s; CPU {fmt_s(prefill_cpu_s)}), {args.decode} tokens in {decode_s:.1f} s after the first | peak RSS {gib_of(peak_rss_bytes())} | "
          f"host pool {gib_of(pool_used)} used of {gib_of(kv.pool.nbytes)} | device bytes "
          f"{sum(device_decode.values()):,} ({device_decode}) | prefill hits/misses "
          f"{s1.hits - s0.hits:,}/{s1.misses - s0.misses:,}, decode {s2.hits - s1.hits:,}/{s2.misses - s1.misses:,} "
          f"| {out}", flush=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.needle.million", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny checkpoint)")
    ap.add_argument("--tokens", type=int, default=MILLION, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens to generate")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--haystack", choices=("corpus", "synthetic"), default="corpus",
                    help="English prose, or the passkey model's training distribution (as benchmarks.needle)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the needle's value and, with --haystack synthetic, the haystack: benchmarks.needle's seed")
    ap.add_argument("--depth", type=float, default=50.0, help="needle depth, percent of the haystack")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (more than 1 spin-waits badly on a busy machine)")
    ap.add_argument("--indexer-build", choices=tuple(INDEXER_BUILDS), default="default",
                    help="the indexer kernel's build: the best filter this CPU has, the bf16 dot filter, or the FMA "
                         "filter alone (A/B)")
    # the KV flags but --kv-offload (always hisparse) and --host-pool-gib (sized to the request)
    KVSettings.add_args(ap, ("layout", "hot_buffer_tokens", "resident_window", "page_tokens"))
    ap.add_argument("--out", default="benchmarks/results/needle/million.json")
    return ap


@contextmanager
def indexer_build(name: str) -> Iterator[None]:
    """While open, the engine's paged top-k (hisparse.kv.scoring calls it through the module) runs kernel build
    `name` of INDEXER_BUILDS."""
    original = indexer_topk.fused_topk_paged
    if name != "default":
        indexer_topk.fused_topk_paged = partial(original, build=INDEXER_BUILDS[name])
    try:
        yield
    finally:
        indexer_topk.fused_topk_paged = original


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.tokens < 1 or args.decode < 1 or args.chunk < 1 or args.threads < 1:
        raise SystemExit("--tokens, --decode, --chunk and --threads must be >= 1")
    try:
        settings = replace(KVSettings.from_args(args), offload="hisparse")
    except KVSettingsError as e:
        raise SystemExit(str(e)) from None
    with indexer_build(args.indexer_build):
        return run(args, settings)


if __name__ == "__main__":
    main()
