"""Decode throughput vs concurrency at one fixed device-memory budget: HiSparse vs all-resident KV.

Both engines get the same device budget B (bytes), set to what `--budget-requests` all-resident requests of
prompt + max_tokens tokens need. A request's device bytes are, with `--kv-offload none`, its latent rows
(the layout's row bytes x KV-owning layers, per token) plus its indexer keys (fp8 + scale x indexer layers, per
token); with HiSparse, the same indexer keys plus its working set on the device (resident window + hot slots,
measured from `HiSparseKV.device_bytes` while it runs). `none` therefore admits B / (its bytes) requests at once
(ResidentKV's token budget; the rest wait in the queue) and HiSparse B / (its bytes) (max_num_seqs). A third
engine, `none_unlimited`, runs all-resident with no budget at HiSparse's concurrency: the compute ceiling of the
batch HiSparse admits, so hisparse / none_unlimited is the cost of offloading at an equal batch. `hisparse` and
`hybrid` running n requests get the same `--device-kv-gib`: B less those requests' indexer keys (the flag covers
latent rows: working sets, and hybrid's resident pages in what they leave), so hybrid admits as many requests as
hisparse; one request keeps all its rows on the device, a saturated batch spills most of them.

At each concurrency C the engine gets C long prompts; once every admitted request has prefilled, `--decode-steps`
pure decode steps are timed: decode tokens/s = generated tokens / their wall time. Writes JSON and a PNG.

    python benchmarks/throughput/run.py [--preset small] [--prompt-len 2048] [--concurrency 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from hisparse.engine.cuda_graphs import GRAPH_MODES, DecodeGraphs, graphs_wanted
from hisparse.engine.full_graph import FullGraphs
from hisparse.engine.engine import Engine
from hisparse.kv.base import LatentKV
from hisparse.kv.settings import KVSettings
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.host_pool.layout import index_row_bytes
from hisparse.core.config import preset_params
from hisparse.kv.geometry import row_layout
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model


def per_token_bytes(cfg, layout: str) -> tuple[int, int]:
    """(latent bytes, indexer-key bytes) one token of context costs on the device when resident."""
    return (row_layout(cfg, layout).row_bytes * len(cfg.kv_owner_layers),
            index_row_bytes(cfg.index_head_dim) * len(cfg.index_owner_layers))


def measure(engine: Engine, prompts: list[list[int]], params: SamplingParams, warmup: int, steps: int,
            on_running=None) -> dict:
    """Prefill every admitted request, then time `steps` pure decode steps."""
    for p in prompts:
        engine.add_request(p, params)
    t0 = time.perf_counter()
    decode_seen = 0
    while decode_seen < warmup:
        st = engine.step()
        decode_seen = decode_seen + 1 if st.prompt_tokens == 0 and st.generation_tokens else 0
    prefill_s = time.perf_counter() - t0
    if on_running is not None:
        on_running()
    before = dataclasses.replace(engine.kv.stats)
    tokens, t0 = 0, time.perf_counter()
    for _ in range(steps):
        st = engine.step()
        assert st.prompt_tokens == 0, "a prefill chunk entered the timed window; raise max_tokens"
        tokens += st.generation_tokens
    dt = time.perf_counter() - t0
    running = st.num_running
    after = engine.kv.stats
    timed = {k: getattr(after, k) - getattr(before, k) for k in ("misses", "hits", "resident_hits")}
    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(r.id)
    engine.step()
    return {"decode_tokens_per_s": tokens / dt, "decode_tokens": tokens, "decode_s": dt, "running": running,
            "step_ms": 1000 * dt / steps, "prefill_s": prefill_s, "timed_decode": timed}


def alternating_steps(engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams,
                      steps: int) -> dict[str, list[float]]:
    """Decode step times (s) of each engine serving `prompts` (as many as it admits), their steps interleaved
    so that machine noise hits them alike (a sequential sweep on a shared CPU drifts by several percent between
    modes), the engines' order rotating every round (no engine always runs after the same other one)."""
    params = dataclasses.replace(params, max_tokens=steps + 8)     # no request ends inside the timed steps
    for eng in engines.values():
        for p in prompts:
            eng.add_request(p, params)
        while eng.step().prompt_tokens:      # prefill, then the first decode step
            pass
    times: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - t0)
    return times


def median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def paired(times: dict[str, list[float]], num: str, den: str) -> dict:
    """Per-round ratios time[num] / time[den] of interleaved steps (den's tokens/s over num's at equal tokens per
    step): their median and quartiles, and the share of rounds above 1."""
    r = sorted(a / b for a, b in zip(times[num], times[den]))
    q1, med, q3 = statistics.quantiles(r, n=4)
    return {"median": med, "q1": q1, "q3": q3, "rounds": len(r), "share_above_1": sum(x > 1 for x in r) / len(r)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--budget-requests", type=int, default=4, help="device budget = this many resident requests")
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    KVSettings.add_args(ap, ["layout", "hot_buffer_tokens", "resident_window", "page_tokens"])
    ap.add_argument("--cuda-graph", choices=GRAPH_MODES, default="full",
                    help="decode steps as CUDA graphs: full (per engine: they hold its store's tables; a padding "
                         "page more in each budget), piecewise (one set for every engine: they hold no KV), off")
    ap.add_argument("--chunk", type=int, default=1024, help="max tokens per forward (prefill chunk budget)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/throughput")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    conc = [int(c) for c in args.concurrency.split(",")]
    model = random_model(preset_params(args.preset), args.seed).to(args.device)
    cfg = model.cfg
    # room for the prefill steps of the last admitted request plus the timed window, so none finishes inside it
    max_tokens = args.warmup + args.decode_steps + 4 + -(-max(conc) * args.prompt_len // args.chunk)
    length = args.prompt_len + max_tokens
    latent_tok, index_tok = per_token_bytes(cfg, args.kv_layout)
    none_req = length * (latent_tok + index_tok)
    budget = args.budget_requests * none_req
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(max(conc))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    # (room too for the interleaved comparisons' longer decodes)
    sched = dict(max_model_len=args.prompt_len + max(max_tokens, 8 * args.decode_steps + 8),
                 max_num_batched_tokens=max(args.chunk, max(conc)))

    settings = dataclasses.replace(KVSettings.from_args(args),
                                   host_pool_gib=max(1.0, 2 * max(conc) * length * latent_tok / 2**30))

    def kv_gib(seqs: int) -> float:
        """--device-kv-gib of an offloading engine running `seqs` requests: what B leaves beside their indexer keys
        (the flag covers latent rows), plus the full graphs' padding slot; the default before `seen` is measured."""
        if not seen:
            return settings.device_kv_gib
        pad_ws = ws_bytes() if graph_mode == "full" else 0
        return (budget - seqs * length * index_tok + pad_ws) / 2**30

    def ws_bytes() -> int:
        """One request's working set (latent rows + LRU metadata), as measured on a running request."""
        return seen["latent"] + seen["hot_metadata"]

    def offloading_kv(offload: str, seqs: int = 1) -> LatentKV:
        return dataclasses.replace(settings, offload=offload, device_kv_gib=kv_gib(seqs)).build(cfg, args.device)

    graph_mode = graphs_wanted(args.cuda_graph, args.device, settings.kernel_path(args.device))
    pieces = DecodeGraphs(model, max(conc), capture=True) if graph_mode == "piecewise" else None
    pad = settings.page_tokens if graph_mode == "full" else 0      # the full graphs' padding page

    def graphs_for(kv: LatentKV, seqs: int) -> DecodeGraphs | FullGraphs | None:
        return FullGraphs(model, kv, max(1, seqs), capture=True) if graph_mode == "full" else pieces

    # HiSparse device bytes per request, measured on one running request
    seen: dict[str, int] = {}
    kv = offloading_kv("hisparse")
    eng = Engine(model, kv, SchedulerConfig(max_num_seqs=1, **sched))
    measure(eng, prompts[:1], params, args.warmup, 1,
            lambda: seen.update(kv.device_bytes(eng.scheduler.running[0].id)))
    hs_req = ws_bytes() + length * index_tok
    limits = {"none": budget // none_req, "hisparse": budget // hs_req}
    print(f"device budget {budget / 2**20:.1f} MiB: none {none_req / 2**20:.2f} MiB/request -> {limits['none']} "
          f"requests; hisparse {hs_req / 2**20:.2f} MiB/request -> {limits['hisparse']} requests", flush=True)

    rows = []
    page = settings.page_tokens
    for mode in ("none", "hisparse", "hybrid", "none_unlimited"):
        for c in conc:
            if mode == "none":   # the budget in the store's page-rounded reservations of `length` tokens each
                kv = ResidentKV(cfg, settings.layout, args.device, page_tokens=page,
                                budget_tokens=limits["none"] * -(-length // page) * page + pad)
                seqs = c
            elif mode in ("hisparse", "hybrid"):    # hybrid: the working sets first, resident pages get the rest
                seqs = min(c, limits["hisparse"])
                kv = offloading_kv(mode, seqs)
            else:
                kv = ResidentKV(cfg, settings.layout, args.device, page_tokens=page)
                seqs = min(c, limits["hisparse"])
            eng = Engine(model, kv, SchedulerConfig(max_num_seqs=max(1, seqs), **sched),
                         graphs=graphs_for(kv, seqs))
            r = measure(eng, prompts[:c], params, args.warmup, args.decode_steps)
            r.update(mode=mode, concurrency=c)
            rows.append(r)
            print(f"{mode:14s} C={c:3d} running={r['running']:3d} decode {r['decode_tokens_per_s']:8.1f} tok/s "
                  f"(step {r['step_ms']:.0f} ms, prefill {r['prefill_s']:.1f} s, decode misses "
                  f"{r['timed_decode']['misses']})", flush=True)

    one = SchedulerConfig(max_num_seqs=1, **sched)
    alternating = median_ms(alternating_steps(
        {"none": Engine(model, ResidentKV(cfg, settings.layout, args.device, page_tokens=page), one),
         "hisparse": Engine(model, offloading_kv("hisparse"), one),
         "hybrid": Engine(model, offloading_kv("hybrid"), one)},
        prompts[:1], params, 4 * args.decode_steps))
    print("one request, interleaved steps (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in alternating.items()),
          flush=True)
    # at saturation: both admit limits["hisparse"] of the max(conc) requests; hybrid's pages get what is left
    seqs = limits["hisparse"]
    full = SchedulerConfig(max_num_seqs=seqs, **sched)
    sat_times = alternating_steps({"hisparse": Engine(model, offloading_kv("hisparse", seqs), full),
                                   "hybrid": Engine(model, offloading_kv("hybrid", seqs), full)},
                                  prompts, params, 8 * args.decode_steps)
    saturated, sat_paired = median_ms(sat_times), paired(sat_times, "hisparse", "hybrid")
    print(f"{seqs} requests, interleaved steps (median ms): " +
          ", ".join(f"{k} {v:.2f}" for k, v in saturated.items()), flush=True)
    result = summarize({
        "benchmark": "decode tokens/s vs concurrency at a fixed device budget", "preset": args.preset,
        "prompt_len": args.prompt_len, "kv_layout": args.kv_layout, "device": args.device,
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "cuda_graphs": graph_mode,
        "device_budget_bytes": budget,
        "device_kv_gib": {"one_request": kv_gib(1), "saturated": kv_gib(seqs)},
        "bytes_per_request": {"none": none_req, "hisparse": hs_req},
        "hisparse_device_bytes_measured": seen, "max_concurrent": limits, "rows": rows,
        "one_request_interleaved_step_ms": alternating,
        "hybrid_over_none_step_c1_interleaved": alternating["hybrid"] / alternating["none"],
        "hisparse_over_none_step_c1_interleaved": alternating["hisparse"] / alternating["none"],
        "saturated_interleaved_step_ms": saturated,
        "hybrid_over_hisparse_tokens_per_s_saturated_interleaved": saturated["hisparse"] / saturated["hybrid"],
        "hybrid_over_hisparse_saturated_paired_rounds": sat_paired})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(result, indent=2))
    print(f"hisparse/none decode tokens/s at C={result['ratio_at']} (none saturated at "
          f"{limits['none']}): {result['ratio']:.2f}x; peak vs peak {result['ratio_peak_vs_peak']:.2f}x; "
          f"concurrent requests at this budget {result['capacity_ratio']:.2f}x")
    print(f"hisparse step at {limits['hisparse']} running / at C=1: {result['step_ratio']:.2f}; hisparse / "
          f"none_unlimited at C={result['ratio_at']}: {result['ratio_vs_unlimited']:.2f}x; none_unlimited / none: "
          f"{result['ceiling_ratio']:.2f}x (the most any offload can gain at this batch)")
    plot(result, out / "throughput.png")
    print(f"hybrid / none step at C=1: {result['hybrid_step_over_none_c1']:.3f} in the sweep, "
          f"{result['hybrid_over_none_step_c1_interleaved']:.3f} interleaved (hisparse / none "
          f"{result['hisparse_over_none_step_c1_interleaved']:.3f}; {result['hybrid_misses_c1']} decode misses); "
          f"hybrid / hisparse decode tokens/s at C={result['ratio_at']}: {result['hybrid_over_hisparse']:.2f}x in the "
          f"sweep, {result['hybrid_over_hisparse_tokens_per_s_saturated_interleaved']:.3f}x interleaved "
          f"({limits['hisparse']} requests each; per interleaved round: median {sat_paired['median']:.3f}, "
          f"quartiles {sat_paired['q1']:.3f}-{sat_paired['q3']:.3f} over {sat_paired['rounds']} rounds)")
    print(f"wrote {out / 'throughput.json'}")


def summarize(result: dict) -> dict:
    """Add the ratios: at the largest concurrency (past none's saturation), peak vs peak, and capacity."""
    tps = {(r["mode"], r["concurrency"]): r["decode_tokens_per_s"] for r in result["rows"]}
    conc = sorted({c for _, c in tps})
    c_max = conc[-1]
    lim = result["max_concurrent"]
    step = {(r["mode"], r["concurrency"]): r["step_ms"] for r in result["rows"]}
    result.update(ratio_at=c_max, ratio=tps[("hisparse", c_max)] / tps[("none", c_max)],
                  ratio_peak_vs_peak=max(tps[("hisparse", c)] for c in conc) / max(tps[("none", c)] for c in conc),
                  capacity_ratio=lim["hisparse"] / lim["none"],
                  step_ratio=step[("hisparse", c_max)] / step[("hisparse", conc[0])],
                  ratio_vs_unlimited=tps[("hisparse", c_max)] / tps[("none_unlimited", c_max)],
                  ceiling_ratio=tps[("none_unlimited", c_max)] / tps[("none", c_max)])
    if ("hybrid", c_max) in tps:
        c1 = conc[0]
        misses = {(r["mode"], r["concurrency"]): r["timed_decode"]["misses"] for r in result["rows"]}
        result.update(hybrid_step_over_none_c1=step[("hybrid", c1)] / step[("none", c1)],
                      hybrid_misses_c1=misses[("hybrid", c1)],
                      hybrid_over_hisparse=tps[("hybrid", c_max)] / tps[("hisparse", c_max)])
    return result


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a one-line note) without the bench extra."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing (the bench extra: pip install -e '.[bench]'): no PNG written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"none": f"none (max {result['max_concurrent']['none']} on device)",
              "hisparse": f"hisparse (max {result['max_concurrent']['hisparse']} on device)",
              "hybrid": f"hybrid (max {result['max_concurrent']['hisparse']}, resident pages in what is left)",
              "none_unlimited": "none, unlimited device memory, at hisparse's concurrency"}
    for mode, style in (("none", "o--"), ("hisparse", "s-"), ("hybrid", "d-"), ("none_unlimited", "^:")):
        if not any(r["mode"] == mode for r in result["rows"]):
            continue
        pts = sorted((r["concurrency"], r["decode_tokens_per_s"]) for r in result["rows"] if r["mode"] == mode)
        ax.plot(*zip(*pts), style, label=labels[mode], color="grey" if mode == "none_unlimited" else None)
    ax.axvline(result["max_concurrent"]["none"], color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{result['preset']} preset, {result['prompt_len']}-token prompts, "
                 f"{result['device_budget_bytes'] / 2**20:.0f} MiB device budget ({result['device']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
