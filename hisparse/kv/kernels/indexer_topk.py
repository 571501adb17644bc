"""Fused CPU indexer scoring + exact top-k (indexer_topk.cpp), built with the system C++ compiler on first use.

Why not a torch C++ extension: the kernel needs only raw pointers, so a plain shared library loaded with ctypes
builds in ~2 s (a torch extension compiles the torch headers for ~1 min and needs ninja). The library is built
with -march=native and cached per user in $HISPARSE_CACHE/kernels (default ~/.cache/hisparse), under a name
that hashes the source, flags, compiler and CPU. Without a working compiler `available()` is False and callers
use the torch path, which gives bit-identical selections. Keys are plain (q's dtype) or the fp8 index cache's
records [rows, dI + 4] uint8 (`kv.index_cache`), decoded by the kernel as it gathers them.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ...core.native import load

SOURCE = Path(__file__).with_name("indexer_topk.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC"]
# built without it where it does not build (one thread); libgomp.so.1 is the runtime torch itself loads, so
# threads are shared, not doubled
OPENMP = ["-fopenmp"]
FUNCTIONS = {torch.float32: "indexer_topk_f32", torch.float64: "indexer_topk_f64"}


@dataclass(frozen=True)
class Build:
    """A build of the kernel. vec_bytes: SIMD width (32 or 64; None = the widest the CPU has, 64 with AVX-512);
    filter: the FMA filter before exact scoring; amx: where the CPU has AMX (and 64-byte lanes), the bf16 tile
    filter in its place for rows whose heaps are full; dot: where the CPU has AVX512_VNNI or AVX512_BF16 (and
    64-byte lanes), the dot filter in its place where the tile filter does not run; dot_int8: the dot filter
    multiplies int8 (VPDPBUSD) where the CPU has AVX512_VNNI, else bf16 (VDPBF16PS); dot_min_work: the least
    HI x dI that takes the dot filter (None: the measured threshold, see indexer_topk.cpp; 1: every shape).
    Every build selects the same keys with the same scores; the default is the fastest, the others are for
    benchmarks/indexer/select.py (32 bytes unfiltered = the kernel before all filters) and the tests."""
    vec_bytes: int | None = None
    filter: bool = True
    amx: bool = True
    dot: bool = True
    dot_int8: bool = True
    dot_min_work: int | None = None

    def defines(self) -> list[str]:
        if self.vec_bytes not in (None, 32, 64):
            raise ValueError(f"vec_bytes must be None, 32 or 64, not {self.vec_bytes}")
        if self.dot_min_work is not None and (isinstance(self.dot_min_work, bool)
                                              or not isinstance(self.dot_min_work, int)):
            raise ValueError(f"dot_min_work must be None or an int, not {self.dot_min_work!r}")
        return ([] if self.vec_bytes is None else [f"-DVEC_BYTES={self.vec_bytes}"]) + \
            ([] if self.filter else ["-DFILTER=0"]) + ([] if self.amx else ["-DAMX=0"]) + \
            ([] if self.dot else ["-DDOT=0"]) + ([] if self.dot_int8 else ["-DDPINT8=0"]) + \
            ([] if self.dot_min_work is None else [f"-DDOT_MIN_WORK={self.dot_min_work}"])


# the FMA filter alone (no tile or dot filter): the baseline the others are timed against
FMA_FILTER = Build(amx=False, dot=False)
# the dot filter in bf16 (VDPBF16PS) where the CPU has AVX512_BF16: the int8 filter's A/B baseline
DOT_BF16_FILTER = Build(amx=False, dot_int8=False)


@cache
def library(build: Build = Build()) -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (with one warning) when it cannot be built."""
    lib = load(SOURCE, [*FLAGS, *build.defines()], OPENMP, "indexer kernel",
               "the indexer uses the slower torch top-k path")
    if lib is None:
        return None
    for name in FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        # q, w, keys, table; table_stride, page_tokens; row_seg, n_visible; T, HI, dI, S, k; cols, scores; threads;
        # records
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + \
            [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p]
    return lib


def has_amx(build: Build = Build()) -> bool:
    """Whether `build` filters with AMX tiles here (the CPU has them and the process may use them)."""
    lib = library(build)
    return lib is not None and bool(lib.indexer_amx())


def has_dot(build: Build = Build()) -> bool:
    """Whether `build` has the dot filter here (the CPU has AVX512_VNNI or AVX512_BF16 and the build 64-byte lanes
    and filters): it filters full rows wherever the AMX filter does not run and HI x dI reaches its threshold."""
    lib = library(build)
    return lib is not None and bool(lib.indexer_dot())


def has_dot_int8(build: Build = Build()) -> bool:
    """Whether `build`'s dot filter multiplies int8 (VPDPBUSD) here, rather than bf16."""
    lib = library(build)
    return lib is not None and bool(lib.indexer_dot_int8())


def full_row_filter(build: Build = Build()) -> str:
    """Which filter `build` runs here on rows whose heaps are full (the dot filter only where HI x dI reaches its
    threshold, see indexer_topk.cpp): "amx", "dot_int8", "dot_bf16", "fma" or "none" (exact scoring alone)."""
    if has_amx(build):
        return "amx"
    if has_dot(build):
        return "dot_int8" if has_dot_int8(build) else "dot_bf16"
    return "fma" if build.filter else "none"


def vec_bytes() -> int:
    """The SIMD width (bytes) of the default build: 64 where the CPU has AVX-512, else 32."""
    lib = library()
    if lib is None:
        raise RuntimeError("the indexer kernel is not built")
    return lib.indexer_vec_bytes()


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return library() is not None


def is_records(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether keys are fp8 key records [rows, dI + 4] uint8 for queries q [..., dI]."""
    return keys.dtype == torch.uint8 and keys.dim() == 2 and keys.shape[1] == q.shape[-1] + 4


def supports(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether fused_topk can take these inputs (CPU, fp32 or fp64, one dtype; keys of it or fp8 records)."""
    return (keys.device.type == "cpu" and q.device.type == "cpu" and q.dtype in FUNCTIONS and q.dtype == wr.dtype
            and (keys.dtype == q.dtype or is_records(q, keys)))


def fused_topk(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, n_visible: torch.Tensor, k: int,
               with_scores: bool = False, build: Build = Build()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact top-k of index_scores over the first n_visible[t] keys of each row, never materialising [T, S].

    q [T, HI, dI], wr [T, HI] (scaled head weights), keys [S, dI] in position order, n_visible [T] (0..S) ->
    cols [T, min(k, S)]: the selected key indices, ascending, -1 padded (score descending, ties to the lower
    index), and with_scores: their scores [T, min(k, S)], -inf padded. For a prefix cache (key s at position s,
    n_visible = p + 1) cols equals select_topk(index_scores(...), k). build: see `Build`.
    """
    lib = library(build)
    if lib is None or not supports(q, wr, keys):
        raise RuntimeError("fused_topk needs the built kernel and CPU fp32/fp64 inputs of one dtype")
    T, HI, dI = q.shape
    S = keys.shape[0]
    if keys.shape[1] != dI + 4 * is_records(q, keys) or wr.shape != (T, HI) or n_visible.shape != (T,):
        raise ValueError(f"fused_topk: shapes q {tuple(q.shape)}, wr {tuple(wr.shape)}, keys {tuple(keys.shape)}, "
                         f"n_visible {tuple(n_visible.shape)} do not match")
    # one segment whose one page holds all S keys
    table = torch.zeros(1, 1, dtype=torch.int64)
    row_seg = torch.zeros(T, dtype=torch.int64)
    return _launch(lib, "fused_topk", q, wr, keys, table, max(S, 1), row_seg, n_visible.to(torch.int64), S, k,
                   with_scores)


def fused_topk_paged(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, page_tokens: int,
                     row_seg: torch.Tensor, n_visible: torch.Tensor, k: int, with_scores: bool = False,
                     build: Build = Build()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fused_topk for a batch of rows of several requests (segments), each reading its keys through a page table.

    keys [N, dI]: the shared arena (or fp8 key records [N, dI + 4] uint8); table [n_segments, P] (int64): each
    segment's page ids, page p = arena rows p * page_tokens .. (p + 1) * page_tokens - 1; row_seg [T] (int64):
    each row's segment; n_visible [T] (int64, 0..S with S = P * page_tokens). Row t's logical key j
    (j < n_visible[t]) is arena row
    table[row_seg[t], j // page_tokens] * page_tokens + j % page_tokens. -> (cols [T, min(k, S)] of logical key
    indices, scores or None), as fused_topk gives on the row's segment's keys gathered in logical order. Rows
    share a cached key block only with neighbouring rows of the same segment, so rows grouped by segment run
    fastest.
    """
    lib = library(build)
    if lib is None:
        raise RuntimeError("fused_topk_paged needs the built kernel")
    tensors = {"q": q, "wr": wr, "keys": keys, "table": table, "row_seg": row_seg, "n_visible": n_visible}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            raise ValueError(f"fused_topk_paged: {name} must be a CPU tensor")
    if q.dtype not in FUNCTIONS:
        raise ValueError(f"fused_topk_paged: q must be float32 or float64, not {q.dtype}")
    if wr.dtype != q.dtype:
        raise ValueError(f"fused_topk_paged: wr must have q's dtype {q.dtype}, not {wr.dtype}")
    if keys.dtype not in (q.dtype, torch.uint8):
        raise ValueError(f"fused_topk_paged: keys must have q's dtype {q.dtype} (or be uint8 fp8 records), not "
                         f"{keys.dtype}")
    for name in ("table", "row_seg", "n_visible"):
        if tensors[name].dtype != torch.int64:
            raise ValueError(f"fused_topk_paged: {name} must be int64, not {tensors[name].dtype}")
    if q.dim() != 3:
        raise ValueError(f"fused_topk_paged: q must be [T, HI, dI], not {tuple(q.shape)}")
    T, HI, dI = q.shape
    expect = {"wr": (T, HI), "row_seg": (T,), "n_visible": (T,)}
    for name, shape in expect.items():
        if tensors[name].shape != shape:
            raise ValueError(f"fused_topk_paged: {name} must be {list(shape)}, not {list(tensors[name].shape)}")
    width = dI + 4 if keys.dtype == torch.uint8 else dI
    if keys.dim() != 2 or keys.shape[1] != width:
        raise ValueError(f"fused_topk_paged: keys must be [N, {width}] ({'fp8 records' if width > dI else 'dI'}), "
                         f"not {list(keys.shape)}")
    if table.dim() != 2:
        raise ValueError(f"fused_topk_paged: table must be [n_segments, pages], not {list(table.shape)}")
    try:
        page_tokens = operator.index(page_tokens)
    except TypeError:
        page_tokens = 0
    if isinstance(page_tokens, bool) or page_tokens < 1:
        raise ValueError("fused_topk_paged: page_tokens must be an int >= 1")
    n_seg, n_pages = table.shape
    S = n_pages * page_tokens
    if T and (int(row_seg.min()) < 0 or int(row_seg.max()) >= n_seg):
        raise ValueError(f"fused_topk_paged: row_seg must lie in [0, {n_seg}) (table has {n_seg} segments)")
    if T and (int(n_visible.min()) < 0 or int(n_visible.max()) > S):
        raise ValueError(f"fused_topk_paged: n_visible must lie in [0, {S}] ({n_pages} pages of {page_tokens})")
    if T and n_pages:
        # every page a row reads must lie in the arena: per segment, the most keys any of its rows sees sets
        # which pages are read, and up to which offset (the last one may be read only in part)
        seen = torch.zeros(n_seg, dtype=torch.int64).scatter_reduce(0, row_seg, n_visible, "amax")
        last = (seen[:, None] - torch.arange(n_pages) * page_tokens).clamp(max=page_tokens) - 1   # <0: unread
        bad = (last >= 0) & ((table < 0) | (table > (keys.shape[0] - 1 - last) // page_tokens))
        if bool(bad.any()):
            seg, page = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"fused_topk_paged: table[{seg}, {page}] = {int(table[seg, page])} is read but not a "
                             f"page of keys ({keys.shape[0]} rows, {page_tokens} per page)")
    return _launch(lib, "fused_topk_paged", q, wr, keys, table, page_tokens, row_seg, n_visible, S, k, with_scores)


def _launch(lib: ctypes.CDLL, caller: str, q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor,
            table: torch.Tensor, page_tokens: int, row_seg: torch.Tensor, n_visible: torch.Tensor, S: int, k: int,
            with_scores: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel on checked inputs (see indexer_topk.cpp) and map its return code to an exception."""
    T, HI, dI = q.shape
    q, wr, keys = q.contiguous(), wr.contiguous(), keys.contiguous()
    table, row_seg, n_vis = table.contiguous(), row_seg.contiguous(), n_visible.contiguous()
    cols = torch.empty(T, min(k, S), dtype=torch.int64)
    scores = torch.empty(T, min(k, S), dtype=q.dtype) if with_scores else None
    records = is_records(q, keys)
    rc = getattr(lib, FUNCTIONS[q.dtype])(q.data_ptr(), wr.data_ptr(), None if records else keys.data_ptr(),
                                          table.data_ptr(), table.shape[1], page_tokens, row_seg.data_ptr(),
                                          n_vis.data_ptr(), T, HI, dI, S, k, cols.data_ptr(),
                                          scores.data_ptr() if with_scores else None, torch.get_num_threads(),
                                          keys.data_ptr() if records else None)
    if rc == 1:
        raise ValueError(f"{caller}: index_n_heads={HI}, index_head_dim={dI}, index_topk={k} must be >= 1")
    if rc == 2:
        raise ValueError(f"{caller}: n_visible must lie in [0, {S}]")
    if rc == 3:
        raise MemoryError(f"{caller}: out of memory for the per-thread buffers (k={k}, HI={HI}, dI={dI})")
    return cols, scores
