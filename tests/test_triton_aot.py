"""Ahead-of-time compilation of every Triton kernel for sm_90 (H100/H200) with no GPU: a kernel that would not
build for the target fails here. Runs in a subprocess without TRITON_INTERPRET (the test process decorates
the kernels for the interpreter) and with an empty Triton cache (every kernel is really compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hisparse.gpu_working_set.kernels import triton_support

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not triton_support.available(), reason="needs triton")]


def test_every_kernel_compiles_for_sm90(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-m", "hisparse.triton_kernels", "--arch", "90"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    from hisparse.triton_kernels import SOURCES
    assert set(result) == set(SOURCES)
    for name, r in result.items():
        assert {"ttgir", "ptx", "cubin"} <= set(r["stages"]) and r["cubin_bytes"] > 0, name
    assert result["index_scores"]["ptx_fma"] == 0     # the indexer's scores round every product and sum
    assert result["index_scores_fp8"]["ptx_fma"] == 0
