"""Every Triton kernel of hisparse, and their ahead-of-time compilation for a GPU target without a GPU:

    python -m hisparse.triton_kernels --arch 90 [--jobs 2]   # sm_90 (H100/H200): every specialisation, as JSON

The specialisations are enumerated from the launch code: the launch functions the stores and the MoE call
(`paged_topk_triton`, `sparse_mla_rows`, `miss_path`, `backup`, `grouped_experts`) run on meta tensors shaped
as the engine shapes them, for every model size (the presets and the shipped checkpoints, at every tensor-
parallel shard), activation dtype, KV layout, index cache, expert weight format and step kind (decode, prefill
chunk), under `triton_support.recording()`, which records each launch's argument types and constexprs instead
of running it. Triton compiles the kernels' IR through ptxas (shipped in the triton wheel), so a specialisation
that would not build for the target fails here, and one that needs more shared memory than the target has
(it would compile and then fail at launch) is reported. Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

from .gpu_working_set.kernels import backup_triton, miss_path_triton
from .core.triton_support import Specialization, recording
from .gpu_working_set.resolver import HotSlots, PageMap
from .host_pool.layout import RowLayout
from .core.config import ModelConfig, preset_params
from .kv.kernels import indexer_triton, sparse_mla_triton, topk_triton
from .model.kernels import moe_triton

SHARED_LIMIT = {90: 232448}   # shared memory one block may use, by target (sm_90: 227 KiB)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("fp8_ds_mla", "bf16")
INDEX_CACHES = ("fp32", "fp8")
TP_SIZES = (1, 2, 4, 8)
CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
DEFAULT_PAGE_TOKENS, DEFAULT_WINDOW, SINKS = 64, 64, 4
DECODE_ROWS, PREFILL_ROWS = 4, 512          # query rows of a decode step (one per request) and of a prefill chunk


def kernels() -> dict[str, object]:
    """name -> JITFunction of every kernel."""
    return {f"{fn.fn.__module__}.{fn.fn.__name__}": fn for fn in (
        miss_path_triton._kernel, backup_triton._backup_kernel, sparse_mla_triton._sparse_mla_kernel,
        indexer_triton._index_scores_kernel, topk_triton._topk_kernel, moe_triton._gate_up_kernel,
        moe_triton._down_kernel)}


def model_sizes() -> dict[str, ModelConfig]:
    """The model sizes the engine serves: the presets and every checkpoint shipped in the repository."""
    sizes = {name: ModelConfig.from_params(preset_params(name)) for name in ("tiny", "small", "full")}
    for params in sorted(CHECKPOINTS.glob("*/params.json")):
        sizes[params.parent.name] = ModelConfig.from_params(json.loads(params.read_text()))
    return sizes


def _meta(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _attention(cfg: ModelConfig, tp: int, dtype: torch.dtype, layout: str, index_cache: str, rows: int) -> None:
    """The KV store's launches of one step with `rows` query rows (one request per row at decode, one request at
    prefill): the indexer's scores and top-k, the miss path and the backups, sparse MLA of RoPE and NoPE layers."""
    rl = RowLayout.create(layout, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    k, P, B = cfg.index_topk, DEFAULT_PAGE_TOKENS, rl.row_bytes
    reqs = rows if rows == DECODE_ROWS else 1
    context = 1 << 17
    pages = _meta(reqs, context // P)
    seg, n_vis = _meta(rows), _meta(rows)
    dI = cfg.index_head_dim
    keys = _meta(reqs * context, dI + 4, dtype=torch.uint8) if index_cache == "fp8" else _meta(reqs * context, dI,
                                                                                              dtype=dtype)
    indexer_triton.paged_topk_triton(_meta(rows, cfg.index_n_heads, dI, dtype=dtype),
                                     _meta(rows, cfg.index_n_heads, dtype=dtype), keys, pages, P, seg, n_vis,
                                     context, k)
    hot = HotSlots(2 * k, torch.device("meta"))
    hot.fit(reqs)
    members = len([s for s in cfg.layers if s.index_source == s.index]) or 1
    arena_rows = reqs * (2 * k + DEFAULT_WINDOW + SINKS) * cfg.n_layers + rows * cfg.n_layers
    pool = _meta(1 << 20, B, dtype=torch.uint8)
    for resident in (None, PageMap(_meta(reqs, context // P), P, _meta(1 << 12))):   # hisparse, hybrid offload
        plan = miss_path_triton.miss_path(
            hot, _meta(reqs), _meta(reqs), _meta(reqs), _meta(reqs), _meta(reqs), SINKS, DEFAULT_WINDOW, seg,
            _meta(rows, k), _meta(), pages, P, pool, _meta(members), _meta(arena_rows, B, dtype=torch.uint8),
            _meta(members, miss_path_triton.N_KINDS), max_rows_per_seg=rows // reqs, resident=resident)
    backup_triton.backup(_meta(rows, B, dtype=torch.uint8), pool, _meta(rows))
    H = cfg.n_heads // tp
    extra = None if plan.extra is None else plan.extra[0]
    for rope in {s.rope for s in cfg.layers}:
        sparse_mla_triton.sparse_mla_rows(
            _meta(rows, H, cfg.kv_lora_rank, dtype=dtype),
            _meta(rows, H, cfg.qk_rope_head_dim, dtype=dtype) if rope else None,
            _meta(arena_rows, B, dtype=torch.uint8), _meta(rows, k), rl, 0.1, extra=extra)


def _experts(cfg: ModelConfig, tp: int, dtype: torch.dtype, fp8: bool, rows: int) -> None:
    """The MoE's grouped-GEMM launches for a tensor-parallel rank's local experts."""
    m = cfg.moe
    if m.num_experts == 0 or m.first_k_dense_replace >= cfg.n_layers:
        return
    E = max(1, m.num_experts // tp)
    wd = torch.float8_e4m3fn if fp8 else dtype
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    w = [_meta(E, m.expert_hidden_dim, cfg.dim, dtype=wd), _meta(E, m.expert_hidden_dim, cfg.dim, dtype=wd),
         _meta(E, cfg.dim, m.expert_hidden_dim, dtype=wd)]
    scales = tuple(_meta(E, math.ceil(a.shape[1] / block[0]), math.ceil(a.shape[2] / block[1]), dtype=torch.float32)
                   for a in w) if fp8 else None
    experts = moe_triton.StackedExperts(*w, scales, tuple(block) if fp8 else None)
    moe_triton.grouped_experts(_meta(rows, cfg.dim, dtype=dtype), _meta(rows, m.num_experts_per_tok),
                               _meta(rows, m.num_experts_per_tok, dtype=dtype), experts, 0)


def specializations() -> dict[Specialization, str]:
    """Every specialisation the engine can launch -> the first configuration that launches it."""
    found: dict[Specialization, str] = {}
    for name, cfg in model_sizes().items():
        for tp in TP_SIZES:
            if cfg.n_heads % tp:
                continue
            for dtype in DTYPES:
                for rows in (DECODE_ROWS, PREFILL_ROWS):
                    step = "decode" if rows == DECODE_ROWS else "prefill"
                    for layout in LAYOUTS:
                        for cache in INDEX_CACHES:
                            with recording() as rec:
                                _attention(cfg, tp, dtype, layout, cache, rows)
                            where = f"{name} tp{tp} {str(dtype)[6:]} {layout} index-cache {cache} {step}"
                            for spec in rec:
                                found.setdefault(spec, where)
                    for fp8 in (True, False):
                        with recording() as rec:
                            _experts(cfg, tp, dtype, fp8, rows)
                        for spec in rec:
                            found.setdefault(spec, f"{name} tp{tp} {str(dtype)[6:]} experts "
                                                   f"{'fp8' if fp8 else 'plain'} {step}")
    return found


def compile_one(spec: Specialization, arch: int = 90) -> dict:
    """Compile one specialisation for CUDA sm_<arch>: stages, sizes, fused multiply-adds in the PTX, warps,
    shared memory, seconds; 'error' holds why it did not compile or would not launch."""
    t0 = time.perf_counter()
    out = {"kernel": spec.kernel.rsplit(".", 1)[1], "constexprs": dict(spec.constexprs),
           "signature": dict(spec.signature)}
    try:
        compiled = triton.compile(spec.source(kernels()[spec.kernel]), target=GPUTarget("cuda", arch, 32),
                                  options=dict(spec.options) or None)
    except Exception as e:   # noqa: BLE001  (every compile error is a result to report)
        return out | {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}",
                      "seconds": round(time.perf_counter() - t0, 1)}
    out |= {"cubin_bytes": len(compiled.asm["cubin"]), "ptx_fma": compiled.asm["ptx"].count("fma.rn"),
            "num_warps": compiled.metadata.num_warps, "shared_bytes": compiled.metadata.shared,
            "seconds": round(time.perf_counter() - t0, 1)}
    if compiled.metadata.shared > SHARED_LIMIT.get(arch, compiled.metadata.shared):
        out["error"] = f"{compiled.metadata.shared} B of shared memory exceed sm_{arch}'s {SHARED_LIMIT[arch]} B"
    return out


def _compile_task(task: tuple[Specialization, int]) -> dict:
    return compile_one(*task)


def compile_all(arch: int = 90, jobs: int = 1) -> dict:
    """Compile every specialisation (`specializations`) for sm_<arch> with `jobs` processes: one result per
    specialisation with the configuration that launches it, and the counts."""
    specs = specializations()
    tasks = [(s, arch) for s in specs]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_compile_task, tasks))
    else:
        results = [_compile_task(t) for t in tasks]
    for r, where in zip(results, specs.values()):
        r["launched_by"] = where
    failed = [r for r in results if "error" in r]
    return {"triton": triton.__version__, "torch": torch.__version__, "arch": arch, "compiled": len(results),
            "failed": len(failed), "per_kernel": {k.rsplit(".", 1)[1]: sum(s.kernel == k for s in specs)
                                                  for k in kernels()},
            "errors": failed, "results": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default: 90)")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--list", action="store_true", help="list the specialisations without compiling")
    a = p.parse_args()
    if a.list:
        for spec, where in specializations().items():
            print(json.dumps({"launched_by": where, **asdict(spec)}, default=str))
        return
    r = compile_all(a.arch, a.jobs)
    print(json.dumps(r, indent=1, default=str))
    print(f"triton {r['triton']}: {r['compiled']} specialisations compiled for sm_{a.arch}, {r['failed']} failed",
          file=sys.stderr)
    sys.exit(1 if r["failed"] else 0)


if __name__ == "__main__":
    main()
