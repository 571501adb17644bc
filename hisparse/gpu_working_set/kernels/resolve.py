"""The fused CPU resolver (resolve.cpp): `resolver.resolve` in one native pass instead of ~45 small torch ops,
built with the system C++ compiler on first use (hisparse.core.native). Without a compiler `library()`
is None and `resolver.resolve` runs its torch code, which gives the same plans.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...core.native import load

if TYPE_CHECKING:
    from ..resolver import PageMap

SOURCE = Path(__file__).with_name("resolve.cpp")
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
ERRORS = {1: (IndexError, "a selected segment is outside [0, S) (slot_of_seg, step_start, step_row0)"),
          2: (IndexError, "a segment's request slot is outside the windows or the hot slots"),
          3: (ValueError, "two segments of the step share a request slot"),
          4: (MemoryError, "out of memory for the resolver's buffers"),
          5: (IndexError, "a selected position is past its segment's page map, or a device page past the stamps")}


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (with one warning) when it cannot be built."""
    lib = load(SOURCE, FLAGS, name="resolver kernel", fallback="the resolver uses the slower torch path")
    if lib is not None:
        fn = lib.hisparse_resolve
        fn.restype = ctypes.c_int
        # seg, sel; n_rows, k; slot_of_seg, step_start, step_row0; n_seg; win_lo, win_len; n_win, sinks, window;
        # hot_pos, hot_stamp; hot_slots, n_slots, stamp; seg_pages; max_pages, page_tokens; page_stamp; n_pages;
        # out, counts
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] + \
            [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + \
            [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] + [ctypes.c_void_p] * 2
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return library() is not None


def fused_resolve(hot_pos: torch.Tensor, hot_stamp: torch.Tensor, hot_slots: int, n_slots: int,
                  slot_of_seg: torch.Tensor, step_start: torch.Tensor, step_row0: torch.Tensor, win_lo: torch.Tensor,
                  win_len: torch.Tensor, sinks: int, window: int, seg: torch.Tensor, sel: torch.Tensor, stamp: int,
                  pages: PageMap | None = None) -> tuple[torch.Tensor, int, int, int, int]:
    """Run the kernel (see resolver.resolve for the arguments; every tensor CPU int64, the metadata hot_pos,
    hot_stamp and the page stamps contiguous, updated in place) -> (out [7, n * k + 1]: keys, kind, local, extra,
    miss_seg, miss_pos, miss_dest, the last three valid in their first n_misses columns; n_unique, n_transient,
    n_misses, n_resident)."""
    seg, sel = seg.contiguous(), sel.contiguous()
    slot_of_seg, step_start, step_row0 = slot_of_seg.contiguous(), step_start.contiguous(), step_row0.contiguous()
    win_lo, win_len = win_lo.contiguous(), win_len.contiguous()
    n_rows, k = sel.shape
    out = torch.empty(7, n_rows * k + 1, dtype=torch.long)
    counts = (ctypes.c_int64 * 4)()
    dev = None if pages is None else pages.dev.contiguous()
    paged = (None, 0, 1, None, 0) if dev is None else (dev.data_ptr(), dev.shape[1], pages.page_tokens,
                                                       pages.stamp.data_ptr(), pages.stamp.numel() - 1)
    rc = library().hisparse_resolve(
        seg.data_ptr(), sel.data_ptr(), n_rows, k, slot_of_seg.data_ptr(), step_start.data_ptr(),
        step_row0.data_ptr(), min(slot_of_seg.numel(), step_start.numel(), step_row0.numel()), win_lo.data_ptr(),
        win_len.data_ptr(), min(win_lo.numel(), win_len.numel()), sinks, window, hot_pos.data_ptr(),
        hot_stamp.data_ptr(), hot_slots, n_slots, stamp, *paged, out.data_ptr(), counts)
    if rc:
        error, message = ERRORS[rc]
        raise error(f"resolve: {message}")
    return out, counts[0], counts[1], counts[2], counts[3]
