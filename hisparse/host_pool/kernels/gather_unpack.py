"""The fused CPU row read (gather_unpack.cpp): `RowLayout.unpack(torch.index_select(store, 0, idx))` in one native
pass, without the packed copy and torch's slow fp8 -> fp32 conversion, built with the system C++ compiler on
first use (hisparse.core.native). Without a compiler `library()` is None and `RowLayout.gather_unpack`
runs the torch code, which gives the same rows bit for bit.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from ...core.native import load

SOURCE = Path(__file__).with_name("gather_unpack.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC"]
# built without it where it does not build (one thread); see indexer_topk.py
OPENMP = ["-fopenmp"]
FUNCTIONS = {torch.float32: "hisparse_gather_unpack_f32", torch.float64: "hisparse_gather_unpack_f64"}


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (with one warning) when it cannot be built."""
    lib = load(SOURCE, FLAGS, OPENMP, "row gather kernel", "rows are read with index_select + RowLayout.unpack")
    if lib is not None:
        for name in FUNCTIONS.values():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            # store, n_rows, row_bytes; idx, m; rank, rope, tile; out; threads
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 4 + \
                [ctypes.c_void_p, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return library() is not None


def supports(store: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether gather_unpack can take these inputs (CPU, a contiguous 2-d uint8 store, int32/int64 idx as
    index_select takes, fp32 or fp64 output)."""
    return (store.device.type == "cpu" and idx.device.type == "cpu" and store.dtype == torch.uint8
            and store.dim() == 2 and store.is_contiguous() and idx.dtype in (torch.int32, torch.int64)
            and dtype in FUNCTIONS)


def gather_unpack(store: torch.Tensor, idx: torch.Tensor, rank: int, rope_dim: int, tile: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows [idx.numel(), rank + rope_dim] in `dtype`: row i = store[idx.flatten()[i]] decoded. store [rows,
    row_bytes] uint8 (see `supports`); tile > 0: the fp8_ds_mla layout with that tile, 0: the bf16 layout."""
    idx = idx.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), rank + rope_dim, dtype=dtype)
    rc = getattr(library(), FUNCTIONS[dtype])(store.data_ptr(), store.shape[0], store.shape[1], idx.data_ptr(),
                                             idx.numel(), rank, rope_dim, tile, out.data_ptr(),
                                             torch.get_num_threads())
    if rc == 1:
        raise IndexError(f"gather_unpack: idx holds a row outside the store's [0, {store.shape[0]})")
    if rc == 2:
        raise ValueError(f"gather_unpack: store rows of {store.shape[1]} B do not match the layout (r={rank}, "
                         f"dR={rope_dim}, tile={tile})")
    return out
