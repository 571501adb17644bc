"""Ahead-of-time compilation for sm_90 (H100/H200) of every kernel specialisation the engine can launch, with no
GPU, under the newest supported triton (this venv) and the oldest (triton 3.6, the CUDA image's, in
.venv-triton36 made by `make test`): a specialisation that would not build for the target, or would need more
shared memory than the target has, fails here. The specialisations are enumerated from the launch code
(`hisparse.triton_kernels.specializations`), and the engine's own launches in a real forward must all be among
them, so a launch site whose specialisations are not compiled fails a test.

Compiles run in subprocesses without TRITON_INTERPRET (the test process decorates the kernels for the
interpreter) and with an empty Triton cache (every specialisation is really compiled)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import summarize
from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings
from hisparse.core import triton_support
from hisparse.core.config import preset_params
from hisparse.model.tiny import random_model

ROOT = Path(__file__).resolve().parents[1]
OLDEST = ROOT / ".venv-triton36" / "bin" / "python"
runnable = triton_support.available() and (torch.cuda.is_available() or triton_support.interpreted())


def _compile_matrix(python: Path, tmp_path: Path, request: pytest.FixtureRequest) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(python), "-m", "hisparse.triton_kernels", "--arch", "90", "--jobs", "2"], env=env,
                         capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert run.stdout, run.stderr[-4000:]
    result = json.loads(run.stdout)
    summarize(request, f"sm_90 AOT, triton {result['triton']}: {result['compiled']} specialisations compiled, "
                       f"{result['failed']} failed ({result['per_kernel']})")
    failed = [f"{e['kernel']} [{e['launched_by']}]: {e['error']}" for e in result["errors"]]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stderr[-4000:]
    return result


def _check(result: dict) -> None:
    assert result["compiled"] > 100 and all(n > 0 for n in result["per_kernel"].values()), result["per_kernel"]
    for r in result["results"]:
        assert r["cubin_bytes"] > 0, r
        if r["kernel"] == "_index_scores_kernel":
            assert r["ptx_fma"] == 0, r          # the indexer's scores round every product and sum


@pytest.mark.slow
@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
def test_every_specialisation_compiles_for_sm90(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _check(_compile_matrix(Path(sys.executable), tmp_path, request))


@pytest.mark.slow
@pytest.mark.skipif(not OLDEST.exists(), reason="needs .venv-triton36 (made by `make test`)")
def test_every_specialisation_compiles_for_sm90_under_triton_3_6(tmp_path: Path,
                                                                  request: pytest.FixtureRequest) -> None:
    result = _compile_matrix(OLDEST, tmp_path, request)
    assert result["triton"].startswith("3.6")
    _check(result)


@pytest.mark.skipif(not runnable, reason="needs triton, and CUDA or the Triton interpreter")
@pytest.mark.parametrize(("offload", "layout", "index_cache", "dtype"),
                         [("hisparse", "fp8_ds_mla", "fp32", torch.float32), ("hisparse", "bf16", "fp8", torch.bfloat16),
                          ("hybrid", "fp8_ds_mla", "fp32", torch.bfloat16), ("none", "fp8_ds_mla", "fp8", torch.bfloat16)])
def test_the_engine_launches_only_enumerated_specialisations(offload: str, layout: str, index_cache: str,
                                                            dtype: torch.dtype, seed: int) -> None:
    """A prefill in chunks (transient misses) and decode steps of the tiny model at the serving defaults, every
    kernel on its Triton path (MoE included): each launch's specialisation is in the compiled list."""
    from hisparse.triton_kernels import specializations
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(preset_params("tiny"), seed=seed % 10_000).to(dev, dtype)
    model.use_kernels("triton")
    kv = KVSettings(offload=offload, layout=layout, index_cache=index_cache, kernels="triton",
                    host_pool_gib=0.01).build(model.cfg, dev, dtype)
    prompt = torch.randint(0, model.cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(seed)).tolist()
    with triton_support.recording(run=True) as launched:
        greedy_generate(model, kv, prompt, 2, chunk=64)
    kernels = {s.kernel.rsplit(".", 1)[1] for s in launched}
    assert {"_sparse_mla_kernel", "_index_scores_kernel", "_topk_kernel", "_gate_up_kernel"} <= kernels
    if offload != "none":
        assert {"_miss_path_kernel", "_backup_kernel"} <= kernels
    missing = set(launched) - set(specializations())
    assert not missing, "launched but not compiled ahead of time:\n" + "\n".join(map(str, missing))


def test_every_launch_goes_through_triton_support_launch() -> None:
    """`kernel[grid](...)` anywhere but in `launch` would bypass the recording the enumeration relies on."""
    direct = []
    for path in (ROOT / "hisparse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id.startswith("_") and \
                    "kernel" in node.func.value.id:
                direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not direct, direct
