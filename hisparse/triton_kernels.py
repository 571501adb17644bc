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

from .gpu_working_set.kernels import miss_path_triton

SOURCES = {"miss_path": miss_path_triton.aot_source}


def compile_all(arch: int = 90, warp_size: int = 32) -> dict[str, dict]:
    """Compile every kernel for CUDA sm_<arch>: per kernel the stages produced, cubin bytes, warps, shared
    memory and compile seconds; raises on the first kernel that does not compile."""
    out = {}
    for name, source in SOURCES.items():
        t0 = time.perf_counter()
        compiled = triton.compile(source(), target=GPUTarget("cuda", arch, warp_size))
        out[name] = {"stages": sorted(compiled.asm), "cubin_bytes": len(compiled.asm["cubin"]),
                     "ptx_bytes": len(compiled.asm["ptx"]), "num_warps": compiled.metadata.num_warps,
                     "shared_bytes": compiled.metadata.shared, "seconds": round(time.perf_counter() - t0, 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default: 90)")
    print(json.dumps(compile_all(p.parse_args().arch), indent=1))


if __name__ == "__main__":
    main()
