"""Every Triton kernel of hisparse, imported together (a test process decorates them all under one interpreter
setting, tests/conftest.py), and their ahead-of-time compilation for a GPU target without a GPU:

    python -m hisparse.triton_kernels --arch 90      # sm_90 (H100/H200): PTX and cubin of every kernel, as JSON

Triton compiles the kernels' IR through ptxas (shipped in the triton wheel), so a kernel that would not build
for the target fails here. Run without TRITON_INTERPRET (interpreted functions cannot be compiled).
"""

from __future__ import annotations

import argparse
import json
import time

import triton
from triton.backends.compiler import GPUTarget

from .gpu_working_set.kernels import backup_triton, miss_path_triton
from .model.kernels import indexer_triton, moe_triton, sparse_mla_triton, topk_triton

SHARED_LIMIT = {90: 232448}   # shared memory one block may use, by target (sm_90: 227 KiB)

SOURCES = {"miss_path": miss_path_triton.aot_source,
           "backup": backup_triton.aot_source,
           "sparse_mla_fp8_ds_mla": lambda: sparse_mla_triton.aot_source("fp8_ds_mla"),
           "sparse_mla_bf16": lambda: sparse_mla_triton.aot_source("bf16"),
           "index_scores": indexer_triton.aot_source,
           "index_scores_fp8": lambda: indexer_triton.aot_source(fp8=True),
           "topk_fp32": lambda: topk_triton.aot_source(32),
           "topk_fp64": lambda: topk_triton.aot_source(64),
           "moe_gate_up_fp8": lambda: moe_triton.aot_sources(fp8=True)["gate_up"],
           "moe_down_fp8": lambda: moe_triton.aot_sources(fp8=True)["down"],
           "moe_gate_up_bf16": lambda: moe_triton.aot_sources(fp8=False)["gate_up"],
           "moe_down_bf16": lambda: moe_triton.aot_sources(fp8=False)["down"]}
# compile options a kernel is launched with (the indexer's rounding contract forbids fused multiply-adds)
OPTIONS = {"index_scores": {"enable_fp_fusion": False}, "index_scores_fp8": {"enable_fp_fusion": False}}


def compile_all(arch: int = 90, warp_size: int = 32) -> dict[str, dict]:
    """Compile every kernel for CUDA sm_<arch>: per kernel the stages produced, cubin and PTX bytes, fused
    multiply-adds in the PTX, warps, shared memory and compile seconds; raises on the first kernel that does not
    compile or that needs more shared memory than the target has (it would compile and then fail at launch)."""
    out = {}
    for name, source in SOURCES.items():
        t0 = time.perf_counter()
        compiled = triton.compile(source(), target=GPUTarget("cuda", arch, warp_size), options=OPTIONS.get(name))
        out[name] = {"stages": sorted(compiled.asm), "cubin_bytes": len(compiled.asm["cubin"]),
                     "ptx_bytes": len(compiled.asm["ptx"]), "ptx_fma": compiled.asm["ptx"].count("fma.rn"),
                     "num_warps": compiled.metadata.num_warps,
                     "shared_bytes": compiled.metadata.shared, "seconds": round(time.perf_counter() - t0, 1)}
        if compiled.metadata.shared > SHARED_LIMIT.get(arch, compiled.metadata.shared):
            raise RuntimeError(f"{name}: {compiled.metadata.shared} B of shared memory exceed sm_{arch}'s "
                               f"{SHARED_LIMIT[arch]} B per block")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default: 90)")
    print(json.dumps(compile_all(p.parse_args().arch), indent=1))


if __name__ == "__main__":
    main()
