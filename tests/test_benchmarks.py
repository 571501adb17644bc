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
    assert {r["mode"] for r in result["rows"]} == {"none", "hisparse", "none_unlimited"}
    assert all(r["decode_tokens"] > 0 for r in result["rows"])
    lim = result["max_concurrent"]
    assert result["capacity_ratio"] == lim["hisparse"] / lim["none"]
    for key in ("ratio", "step_ratio", "ratio_vs_unlimited", "ceiling_ratio"):
        assert result[key] > 0
