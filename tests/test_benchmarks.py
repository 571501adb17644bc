"""The throughput benchmarks run end to end on a tiny model (their figures are measured on the small preset)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_benchmark_runs_and_reports_its_ratios(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "benchmarks/throughput/run.py", "--preset", "tiny", "--prompt-len", "64",
                    "--concurrency", "1,4", "--decode-steps", "2", "--threads", "1", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    result = json.loads((tmp_path / "throughput.json").read_text())
    assert {r["mode"] for r in result["rows"]} == {"none", "hisparse", "hybrid", "none_unlimited"}
    assert all(r["decode_tokens"] > 0 for r in result["rows"])
    lim = result["max_concurrent"]
    assert result["capacity_ratio"] == lim["hisparse"] / lim["none"]
    for key in ("ratio", "step_ratio", "ratio_vs_unlimited", "ceiling_ratio", "hybrid_step_over_none_c1",
                "hybrid_over_hisparse"):
        assert result[key] > 0
    assert result["hybrid_misses_c1"] == 0     # one request: every row resident


def test_node_table_reproduces_the_spec_arithmetic(tmp_path: Path) -> None:
    """The full preset built on the meta device: the spec's per-token bytes (§4) and parameter count (§1.4)."""
    out = tmp_path / "node_table.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.node_table", "--out", str(out)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=300)
    assert "| per rank | TP1 | TP8 DCP8 | seed 000 |" in run.stdout
    r = json.loads(out.read_text())
    kv, w = r["TP1"]["kv"], r["TP1"]["weights"]
    assert kv["fp8"]["index_bytes_per_token_layer"] == 132 and kv["fp32"]["index_bytes_per_token_layer"] == 512
    assert kv["fp8"]["without_hisparse"] == 47_136 and kv["fp8"]["with_hisparse"] == 5_808
    assert kv["fp32"]["without_hisparse"] == 41_328 + 44 * 512 and kv["fp32"]["with_hisparse"] == 44 * 512
    assert abs(w["total"]["params"] / 1.051e12 - 1) < 0.002                 # spec §1.4: 1.051 T
    assert abs(w["routed_experts"]["params"] / 1029.18e9 - 1) < 1e-4
    assert w["total"]["params"] < w["total"]["fp8_bytes"] < 1.01 * w["total"]["params"] < w["total"]["bf16_bytes"]
    ctx = r["TP1"]["context_after_fp8_weights"]["fp8"]["without_hisparse"]
    assert ctx["tokens"] == 0 and ctx["free_bytes"] == r["device_bytes"] - w["total"]["fp8_bytes"] < 0
    # TP8: rank 0's share from TensorParallel's own sharding: 1/8 of the experts, more than 1/8 of the whole
    # (replicated indexer, latent head, norms, drafter)
    w8 = r["TP8_DCP8"]["weights"]
    assert w8["routed_experts"]["params"] * 8 == w["routed_experts"]["params"]
    assert w["total"]["params"] / 8 < w8["total"]["params"] < w["total"]["params"] / 7
    node = r["TP8_DCP8"]["context_after_fp8_weights_dcp8"]["fp8"]
    assert node["without_hisparse"]["free_bytes"] == r["device_bytes"] - w8["total"]["fp8_bytes"] > 0
    assert node["without_hisparse"]["tokens"] == int(node["without_hisparse"]["free_bytes"] // (47_136 / 8))
    assert r["TP8_DCP8"]["ratio_node_context_hisparse_vs_resident"]["fp8"] > 7


def test_gpu_benchmark_runs_its_cpu_smoke_and_measures_overlap(tmp_path: Path) -> None:
    """benchmarks/gpu/run.py --quick on the CPU: P3 and P5 from a real throughput run, P7 with uncaptured
    pieces, the profiled decode path traced (P2 and P6 need a GPU and say so); the overlap arithmetic on a known
    timeline."""
    from benchmarks.gpu.run import overlap_share
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", "--quick", "--device", "cpu", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    r = json.loads((tmp_path / "gpu.json").read_text())
    assert r["P3_step_ratio_batch1"] > 0 and r["P5_tokens_per_s_ratio"] > 0
    assert r["P7_graph_over_eager_batch16"] > 0 and r["P7_detail"]["captured"] is False
    assert r["P2_miss_path_over_memcpy"] is None and "need CUDA" in r["P2_P6_note"]
    assert r["trace_smoke"]["h2d_bytes"] > 0 and r["trace_smoke"]["events"] > 0
    copy = {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 0, "dur": 10, "args": {"stream": 7}}
    kernels = [{"cat": "kernel", "name": "a", "ts": 5, "dur": 15, "args": {"stream": 1}},
               {"cat": "kernel", "name": "b", "ts": 6, "dur": 2, "args": {"stream": 1}},     # inside a: once
               {"cat": "kernel", "name": "c", "ts": 0, "dur": 10, "args": {"stream": 7}}]    # same stream: not
    assert overlap_share([copy, *kernels]) == {"copy_us": 10, "hidden_us": 5, "share": 0.5, "copies": 1}
