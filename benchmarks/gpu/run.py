"""The GPU figures of the HiSparse data path in one run (about 10 minutes on one GPU), as one JSON:

  P2  miss path: bytes per second the Triton miss-path kernel moves host -> device (UVA reads of the pinned pool)
      over a plain pinned -> device memcpy of the same bytes;
  P3  decode step time at batch 1, HiSparse / all-resident (the cost of offloading one request);
  P5  decode tokens/s at a fixed device budget at saturation, HiSparse / all-resident (benchmarks/throughput);
  P6  share of the torch path's side-stream miss copies (cudaMemcpy host -> device) that overlaps kernels on
      other streams (copies hidden behind compute);
  P7  decode step time with full-step and piecewise CUDA graphs over eager (`--cuda-graph full` / `piecewise` /
      `off`), HiSparse with the Triton kernels, at batch 1 and 16 (absolute step times in the detail);
  P8  share of the wall time of 16-request full-step decode steps in which the GPU runs a kernel.

P3 and P5 come from `benchmarks/throughput/run.py` on the device; P2 and P6 from a torch.profiler trace of
HiSparse decode steps (kernels and copies with their streams, from the trace's JSON). Without CUDA, `--quick`
runs P3, P5 and P7 (uncaptured pieces) on the CPU at small sizes (a smoke run of the script) and reports P2 and
P6 as needing CUDA.

    benchmarks/gpu/run.sh [--out benchmarks/results/gpu]           # on a machine with a GPU
    python -m benchmarks.gpu.run --quick --device cpu --out DIR     # the CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hisparse.engine.cuda_graphs import DecodeGraphs
from hisparse.engine.full_graph import FullGraphs
from hisparse.engine.engine import Engine
from hisparse.kv.settings import KVSettings
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.core.config import preset_params
from hisparse.model.tiny import random_model

ROOT = Path(__file__).resolve().parents[2]


# benchmarks/throughput/run.py's arguments at each size: the CPU smoke run, the GPU check's (benchmarks/gpu/check.py:
# a minute or two), the full figures
THROUGHPUT_ARGS = {
    "quick": ["--preset", "tiny", "--prompt-len", "256", "--concurrency", "1,2,4", "--decode-steps", "2"],
    "check": ["--preset", "small", "--prompt-len", "2048", "--concurrency", "1,4,16", "--decode-steps", "4"],
    "full": ["--preset", "small", "--prompt-len", "4096", "--concurrency", "1,4,16,32,64", "--decode-steps", "8"]}


def throughput(device: str, size: str, out: Path) -> dict:
    """P3 and P5 from one run of benchmarks/throughput/run.py on `device`."""
    args = THROUGHPUT_ARGS[size]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "throughput" / "run.py"), *args, "--device", device,
           "--out", str(out / "throughput")]
    subprocess.run(cmd, check=True, cwd=ROOT)
    r = json.loads((out / "throughput" / "throughput.json").read_text())
    step = {(row["mode"], row["concurrency"]): row["step_ms"] for row in r["rows"]}
    return {"P3_step_ratio_batch1": step[("hisparse", 1)] / step[("none", 1)],
            "P3_step_ms_batch1": {"hisparse": step[("hisparse", 1)], "none": step[("none", 1)]},
            "P5_tokens_per_s_ratio": r["ratio"], "P5_at_concurrency": r["ratio_at"],
            "P5_max_concurrent": r["max_concurrent"], "throughput_command": " ".join(cmd)}


def decode_trace(kernels: str, device: str, prompt_len: int, steps: int, trace: Path) -> dict:
    """HiSparse decode steps of 4 requests under torch.profiler; the trace's JSON at `trace`, the bytes copied."""
    model = random_model(preset_params("small"), 0).to(device)
    settings = KVSettings(offload="hisparse", host_pool_gib=4.0, hot_buffer_tokens=256, resident_window=64,
                          kernels=kernels)
    kv = settings.attach(model)
    eng = Engine(model, kv, SchedulerConfig(max_model_len=prompt_len + 64, max_num_seqs=4,
                                            max_num_batched_tokens=1024))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        eng.add_request(torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist(),
                        SamplingParams(max_tokens=64, temperature=0.0))
    while not ((st := eng.step()).prompt_tokens == 0 and st.generation_tokens):   # prefill every request
        pass
    eng.step()                                           # warm: every request decoding
    before = kv.stats.snapshot()
    cuda = torch.device(device).type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    return {"h2d_bytes": kv.stats.host_to_device_bytes - before.host_to_device_bytes,
            "misses": kv.stats.misses - before.misses}


def graph_steps(device: str, quick: bool) -> dict:
    """P7: mean decode step time (ms) with full-step and piecewise CUDA graphs and eager, at batch 1 and 16 (same
    prompts)."""
    cuda = torch.device(device).type == "cuda"
    preset, prompt_len, steps = ("tiny", 64, 2) if quick else ("small", 2048, 16)
    model = random_model(preset_params(preset), 0).to(device)
    settings = KVSettings(offload="hisparse", host_pool_gib=4.0, hot_buffer_tokens=256, resident_window=64,
                          kernels="triton" if cuda else "torch")
    kv = settings.attach(model)      # sets the model's kernel path before the graphs capture it
    graphs = DecodeGraphs(model, 16, capture=cuda)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(16)]
    out: dict = {}
    for batch in (1, 16):
        for name in ("full", "graphs", "eager"):
            kv = settings.attach(model) if kv is None else kv    # a fresh store for every run
            decode = {"full": lambda: FullGraphs(model, kv, 16, capture=cuda), "graphs": lambda: graphs,
                      "eager": lambda: None}[name]()
            eng = Engine(model, kv, graphs=decode,
                         cfg=SchedulerConfig(max_model_len=prompt_len + 64, max_num_seqs=batch,
                                             max_num_batched_tokens=4096))
            for p in prompts[:batch]:
                eng.add_request(p, SamplingParams(max_tokens=steps + 8, temperature=0.0))
            while not ((st := eng.step()).prompt_tokens == 0 and st.generation_tokens):   # prefill everything
                pass
            eng.step()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            if cuda:
                torch.cuda.synchronize()
            out[f"{name}_ms_batch{batch}"] = (time.perf_counter() - t0) / steps * 1e3
            if cuda and name == "full" and batch == 16:
                out["busy"] = busy_share(eng, steps)
            kv = None
    return {"P7_graph_over_eager_batch1": out["graphs_ms_batch1"] / out["eager_ms_batch1"],
            "P7_graph_over_eager_batch16": out["graphs_ms_batch16"] / out["eager_ms_batch16"],
            "P7_full_over_eager_batch1": out["full_ms_batch1"] / out["eager_ms_batch1"],
            "P7_full_over_eager_batch16": out["full_ms_batch16"] / out["eager_ms_batch16"],
            "P8_gpu_busy_share_batch16": out["busy"]["share"] if cuda else None,
            "P7_detail": {**out, "captured": cuda, "preset": preset, "prompt_len": prompt_len}}


def busy_share(eng: Engine, steps: int) -> dict:
    """P8: of the wall time of `steps` whole decode steps (sampling and the token read-back included), the share
    in which a kernel runs (the union of the kernels' intervals in a torch.profiler trace)."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) * 1e6
        trace = Path(tmp) / "busy.json"
        prof.export_chrome_trace(str(trace))
        kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events(trace) if e.get("cat") == "kernel")
    busy, end = 0.0, float("-inf")
    for a, b in kernels:                                    # union of the kernel intervals
        a = max(a, end)
        if b > a:
            busy, end = busy + b - a, b
    return {"share": busy / wall_us, "kernel_us": busy, "wall_us": wall_us, "kernels": len(kernels)}


def trace_events(trace: Path) -> list[dict]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]


def memcpy_gbps(nbytes: int, device: str) -> float:
    """GB/s of one pinned host -> device copy of nbytes (best of 5)."""
    src = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return src.numel() / best / 1e9


def overlap_share(events: list[dict]) -> dict:
    """Of the host -> device memcpy time, the share during which a kernel runs on another stream."""
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    total = hidden = 0.0
    for c in copies:
        a, b = c["ts"], c["ts"] + c["dur"]
        spans = sorted((max(a, k["ts"]), min(b, k["ts"] + k["dur"])) for k in kernels
                       if k["args"].get("stream") != c["args"].get("stream") and k["ts"] < b and k["ts"] + k["dur"] > a)
        covered, end = 0.0, a
        for s, t in spans:                                  # union of the overlapping kernel intervals
            s = max(s, end)
            if t > s:
                covered, end = covered + t - s, t
        total, hidden = total + (b - a), hidden + covered
    return {"copy_us": total, "hidden_us": hidden, "share": hidden / total if total else None,
            "copies": len(copies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU smoke run)")
    ap.add_argument("--check", action="store_true",
                    help="sizes that finish in about two minutes on one GPU (benchmarks/gpu/check.sh)")
    ap.add_argument("--prompt-len", type=int, default=16384, help="P2/P6: prompt tokens per request")
    ap.add_argument("--steps", type=int, default=8, help="P2/P6: profiled decode steps")
    ap.add_argument("--out", default="benchmarks/results/gpu")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = {"benchmark": "GPU figures P2 P3 P5 P6 P7 P8", "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "machine": platform.processor() or platform.machine(), "quick": args.quick}
    if args.check:
        args.prompt_len, args.steps = min(args.prompt_len, 2048), min(args.steps, 2)
    result["size"] = "quick" if args.quick else "check" if args.check else "full"
    result.update(throughput(args.device, result["size"], out))
    result.update(graph_steps(args.device, args.quick or args.check))
    if args.device.startswith("cuda"):
        with tempfile.TemporaryDirectory() as tmp:
            triton_trace, torch_trace = Path(tmp) / "triton.json", Path(tmp) / "torch.json"
            moved = decode_trace("triton", args.device, args.prompt_len, args.steps, triton_trace)
            kernel_s = sum(e["dur"] for e in trace_events(triton_trace)
                           if e.get("cat") == "kernel" and "_miss_path_kernel" in e["name"]) / 1e6
            gbps = moved["h2d_bytes"] / kernel_s / 1e9 if kernel_s else None
            per_step = moved["h2d_bytes"] // max(1, args.steps)
            base = memcpy_gbps(per_step, args.device)
            result["P2_miss_path_over_memcpy"] = gbps / base if gbps else None
            result["P2_detail"] = {"miss_path_gbps": gbps, "memcpy_gbps": base, **moved,
                                   "miss_path_kernel_s": kernel_s}
            decode_trace("torch", args.device, args.prompt_len, args.steps, torch_trace)
            ov = overlap_share(trace_events(torch_trace))
            result["P6_hidden_copy_share"], result["P6_detail"] = ov["share"], ov
    else:   # the trace path runs (torch kernels, CPU events only), the figures need a GPU
        with tempfile.TemporaryDirectory() as tmp:
            moved = decode_trace("torch", args.device, 512 if args.quick else args.prompt_len, 2, Path(tmp) / "t.json")
            result["trace_smoke"] = {**moved, "events": len(trace_events(Path(tmp) / "t.json"))}
        result["P2_miss_path_over_memcpy"] = result["P6_hidden_copy_share"] = None
        result["P2_P6_note"] = "need CUDA (a GPU trace of the miss-path kernel and of side-stream copies)"
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not k.endswith(("detail", "command"))}, indent=1))
    print(f"wrote {out / 'gpu.json'}")


if __name__ == "__main__":
    main()
