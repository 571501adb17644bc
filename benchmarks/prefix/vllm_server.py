"""`vllm serve` with the HiSparseConnector as the prefix benchmark runs it (the venv scripts/install_vllm.sh makes)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from benchmarks.hisparse_server import wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def start_vllm(model_dir: Path, caching: bool, max_len: int, port: int, threads: int, log: Path,
               venv: Path = ROOT / ".venv-vllm") -> subprocess.Popen:
    """`vllm serve MODEL` (float32, eager) with the connector, prefix caching on or off, once /health answers."""
    extra = {"host_pool_gib": 4, "enable_prefix_caching": caching}
    kvt = {"kv_connector": "HiSparseConnector", "kv_connector_module_path": "hisparse.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": extra}
    cmd = [str(venv / "bin" / "vllm"), "serve", str(model_dir.resolve()), "--port", str(port), "--enforce-eager",
           "--dtype", "float32", "--max-model-len", str(max_len), "--max-num-batched-tokens", "4096",
           "--kv-transfer-config", json.dumps(kvt)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
               VLLM_USE_V2_MODEL_RUNNER="0", OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    return wait_healthy(proc, port, log, "vllm serve", 600)
