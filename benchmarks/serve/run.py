"""`vllm bench serve` against `hisparse serve` at one device budget: HiSparse vs `--kv-offload none`.

The device budget B is what `--budget-requests` all-resident requests of input + output tokens need (latent rows
plus indexer keys per token, as benchmarks/throughput/run.py); a HiSparse request needs its measured working set
(resident window + hot slots) plus the same indexer keys. Each server's `--max-num-seqs` is the number of
requests B holds (the rest wait in its queue), so both run with the same device memory. For each mode the script
starts `hisparse serve`, runs vLLM's own serving benchmark (random dataset, `--ignore-eos`) at every concurrency,
and writes each run's result JSON plus a summary (TTFT, TPOT, output tokens/s) to `--out`.

    python -m benchmarks.serve.run [--input-len 256] [--output-len 32] [--concurrency 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.hisparse_server import start_serve
from benchmarks.throughput.run import measure, per_token_bytes
from hisparse.engine.engine import Engine
from hisparse.kv.settings import KVSettings
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.model.tiny import builtin_tiny
from hisparse.model.weights import load_model

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
          "p99_tpot_ms", "output_throughput", "total_token_throughput", "duration")


def device_limits(model_dir: Path, length: int, budget_requests: int, layout: str) -> dict:
    """Requests the device budget holds per mode, and the bytes behind it."""
    model = load_model(model_dir)
    cfg = model.cfg
    latent_tok, index_tok = per_token_bytes(cfg, layout)
    none_req = length * (latent_tok + index_tok)
    budget = budget_requests * none_req
    kv = KVSettings(offload="hisparse", layout=layout, host_pool_gib=0.5).build(cfg)
    eng = Engine(model, kv, SchedulerConfig(max_model_len=length, max_num_seqs=1, max_num_batched_tokens=512))
    seen: dict[str, int] = {}
    prompt = torch.randint(1000, cfg.vocab_size, (length - 8,), generator=torch.Generator().manual_seed(0)).tolist()
    measure(eng, [prompt], SamplingParams(max_tokens=8, temperature=0.0), 1, 1,
            lambda: seen.update(kv.device_bytes(eng.scheduler.running[0].id)))
    hs_req = seen["latent"] + seen.get("hot_metadata", 0) + length * index_tok
    return {"device_budget_bytes": budget, "bytes_per_request": {"none": none_req, "hisparse": hs_req},
            "max_num_seqs": {"none": budget // none_req, "hisparse": budget // hs_req}}


def serve(model_dir: Path, mode: str, max_num_seqs: int, max_model_len: int, port: int, threads: int,
          log: Path) -> subprocess.Popen:
    return start_serve(["--model", str(model_dir), "--kv-offload", mode, "--max-num-seqs", str(max_num_seqs),
                        "--max-model-len", str(max_model_len), "--host-pool-gib", "1"], port, threads, log)


def bench(vllm: Path, port: int, name: str, model_dir: Path, args: argparse.Namespace, c: int, raw: Path,
          mode: str) -> dict:
    """One `vllm bench serve` run; its result JSON (raw/<mode>_c<C>.json)."""
    fname = f"{mode}_c{c}.json"
    cmd = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", name, "--tokenizer", str(model_dir), "--tokenizer-mode",
           "mistral", "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(max(args.min_prompts, args.prompts_per_client * c)),
           "--max-concurrency", str(c), "--ignore-eos", "--seed", str(args.seed), "--save-result", "--result-dir",
           str(raw), "--result-filename", fname]
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads((raw / fname).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny checkpoint)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts-per-client", type=int, default=4, help="--num-prompts = this x concurrency")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--budget-requests", type=int, default=4, help="device budget = this many resident requests")
    ap.add_argument("--kv-layout", default="fp8_ds_mla")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of each server")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--out", default="benchmarks/results/serve")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else builtin_tiny()
    out, vllm = Path(args.out), Path(args.vllm_venv) / "bin" / "vllm"
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    length = args.input_len + args.output_len
    limits = device_limits(model_dir, length, args.budget_requests, args.kv_layout)
    print(f"device budget {limits['device_budget_bytes'] / 2**20:.2f} MiB -> max-num-seqs {limits['max_num_seqs']}",
          flush=True)
    rows = []
    for mode in ("hisparse", "none"):
        proc = serve(model_dir, mode, limits["max_num_seqs"][mode], length + 16, args.port, args.threads,
                     Path(tempfile.mkdtemp()) / f"serve_{mode}.log")
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                r = bench(vllm, args.port, model_dir.name, model_dir, args, c, raw, mode)
                rows.append({"mode": mode, "concurrency": c, "num_prompts": r["num_prompts"],
                             **{k: r[k] for k in FIELDS}})
                print(f"{mode:9s} C={c:3d} TTFT {r['mean_ttft_ms']:8.1f} ms  TPOT {r['mean_tpot_ms']:7.1f} ms  "
                      f"{r['output_throughput']:7.1f} output tok/s  failed {r['failed']}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    result = {"benchmark": "vllm bench serve (random dataset, /v1/completions) at one device budget",
              "model": model_dir.name, "input_len": args.input_len, "output_len": args.output_len,
              "kv_layout": args.kv_layout, "machine": platform.processor() or platform.machine(),
              "server_threads": args.threads, "command": " ".join(["python -m benchmarks.serve.run", *sys.argv[1:]]),
              **limits, "rows": rows}
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'serve.json'}")


if __name__ == "__main__":
    main()
