"""One check of hisparse on a GPU machine, from the source tree (`benchmarks/gpu/check.sh` sets it up):

  1. tests  the CUDA tests: every Triton kernel and store test, CUDA graphs, pinned pool, host syncs, the capture
            audit and the kernels' barriers (the kernels compiled on the device, not interpreted);
  2. serve  `hisparse serve --device cuda` on the trained needle-ml4 answering needle prompts through
            `benchmarks.needle`: --quick, with its defaults (bf16, Triton kernels, CUDA graphs, hybrid offload), 5 at
            8k; the full check always offloading (`--kv-offload hisparse`, so rows really come from the host) and
            all-resident (`--kv-offload none`), comparing the answers at 8k and 32k (5 depths each: HiSparse on ==
            off);
  3. figures (full check only) the GPU figures P2, P3, P5, P6, P7 of `benchmarks.gpu.run` at sizes that finish.

Writes at most 8 files into DIR (check.json, tests.log, serve-hisparse.log, serve-none.log, needle.json,
figures.json, figures.log) and prints a summary; exit status 1 when a stage failed.

    benchmarks/gpu/check.sh DIR [--wheels WHEELDIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.hisparse_server import start_serve

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "checkpoints" / "needle-ml4"
CUDA_TESTS = ["tests/test_triton_miss_path.py", "tests/test_triton_sparse_mla.py", "tests/test_triton_indexer.py",
              "tests/test_triton_backup.py", "tests/test_triton_moe.py", "tests/test_triton_kv.py",
              "tests/test_cuda_graphs.py", "tests/test_full_graph.py::test_recorded_steps_replay_the_eager_tokens",
              "tests/test_pinned_pool.py", "tests/test_host_sync.py", "tests/test_capture_audit.py",
              "tests/test_kernel_barriers.py", "tests/test_triton_aot.py"]
# compiling the whole matrix ahead of time is the CPU's job (CI); on the device the kernels compile as they launch
CUDA_TESTS_DESELECT = "not compiles_for_sm90"
SERVER_THREADS = 4          # CPU threads of each server process


def run_tests(out: Path, budget_s: int) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", CUDA_TESTS_DESELECT, *CUDA_TESTS]
    with open(out / "tests.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=budget_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = (out / "tests.log").read_text()
    tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    failed = re.findall(r"^FAILED (\S+)", text, re.M)
    return {"ok": rc == 0, "returncode": rc, "summary": tail[-1] if tail else None, "failed": failed,
            "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(cmd[2:])}


def run_serve(out: Path, device: str, quick: bool, budget_s: int) -> dict:
    """Needle prompts through the default server (quick), or through an always-offloading server compared with an
    all-resident one (full)."""
    t0 = time.perf_counter()
    common = ["--model", str(MODEL), "--device", device, "--max-model-len", "40000", "--host-pool-gib", "8"]
    wanted = [(18731, out / "serve-hisparse.log", common if quick else [*common, "--kv-offload", "hisparse"])]
    if not quick:
        wanted.append((18732, out / "serve-none.log", [*common, "--kv-offload", "none"]))
    result: dict = {"servers": [" ".join(flags) for _, _, flags in wanted]}
    servers = []
    try:
        try:
            for port, log, flags in wanted:
                servers.append(start_serve(flags, port, SERVER_THREADS, log))
        except SystemExit as e:   # start_serve's report: the server exited or did not start, with its log
            result |= {"ok": False, "error": str(e)[-2000:]}
            return result
        startup = (out / "serve-hisparse.log").read_text()
        result["graphs"] = next((ln.strip() for ln in startup.splitlines() if "CUDA graphs" in ln), None)
        urls = [f"http://127.0.0.1:{port}/v1" for port, _, _ in wanted]
        lengths = "8k" if quick else "8k,32k"
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "benchmarks.needle", "--base-url", urls[0], "--api", "completions",
                   "--haystack", "synthetic", "--tokenizer", str(MODEL), "--max-tokens", "10", "--lengths", lengths,
                   "--depths", "0,25,50,75,100", "--seeds", "1", "--out", tmp]
            if not quick:
                cmd += ["--compare-base-url", urls[1]]
            budget = max(30, budget_s - (time.perf_counter() - t0))
            try:
                run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget)
                result["needle_returncode"] = run.returncode
            except subprocess.TimeoutExpired:
                result["needle_returncode"] = "timeout"
            result["needle_command"] = " ".join(cmd[2:])
            if (Path(tmp) / "needle.json").exists():
                shutil.copy(Path(tmp) / "needle.json", out / "needle.json")
                summary = json.loads((Path(tmp) / "needle.json").read_text())["summary"]
                result["needle"] = {k: summary[k] for k in ("records", "retrieval", "errors", "agreement")
                                    if k in summary}
        s = result.get("needle", {})
        errors = sum((s.get("errors") or {}).values()) if s else None
        agree = (s.get("agreement") or {}).get("rate") if s else None
        result["ok"] = bool(s) and s.get("records", 0) > 0 and errors == 0 and (quick or agree == 1.0)
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(30)
        result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def run_figures(out: Path, device: str, budget_s: int) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "benchmarks.gpu.run", "--device", device, "--check", "--out", tmp]
        with open(out / "figures.log", "w") as log:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=budget_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        fig = Path(tmp) / "gpu.json"
        figures = json.loads(fig.read_text()) if fig.exists() else None
        if figures:
            shutil.copy(fig, out / "figures.json")
    keep = {k: v for k, v in (figures or {}).items() if k.startswith("P") and not k.endswith("detail")}
    return {"ok": rc == 0 and figures is not None, "returncode": rc, "figures": keep,
            "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(cmd[2:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="tests + 5 needle prompts on the default server only")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (interpreted kernels)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    import triton
    result = {"check": "quick" if a.quick else "full", "device": a.device,
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
              "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip() or None}
    result["tests"] = run_tests(a.out, 100 if a.quick else 150)
    print("tests:", result["tests"]["summary"], flush=True)
    result["serve"] = run_serve(a.out, a.device, a.quick, 60 if a.quick else 150)
    print("serve:", json.dumps({k: result["serve"].get(k) for k in ("ok", "needle", "graphs")}), flush=True)
    if not a.quick:
        result["figures"] = run_figures(a.out, a.device, 75)
        print("figures:", json.dumps(result["figures"]["figures"]), flush=True)
    result["ok"] = all(result[k]["ok"] for k in ("tests", "serve", "figures") if k in result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (a.out / "check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"ok": result["ok"], "seconds": result["seconds"], "failed_tests": result["tests"]["failed"]}))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
