"""Backups of new rows in Triton: a step's rows scattered from the device straight into their host-pool rows
(on CUDA the pool is pinned and mapped, and the kernel writes it over UVA), ordered on the stream that wrote
them, so the next step's miss path (same stream) reads them with no host copy in between."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.triton_support import launch, next_pow2, require


@triton.jit
def _backup_kernel(src_ptr, dst_ptr, rows_ptr, n, W: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.arange(0, BLOCK_W)
    live = r < n
    dest = tl.load(rows_ptr + r, mask=live, other=0)
    m = live[:, None] & (w[None, :] < W)
    words = tl.load(src_ptr + r[:, None].to(tl.int64) * W + w[None, :], mask=m)
    tl.store(dst_ptr + dest[:, None] * W + w[None, :], words, mask=m)


def backup(data: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, block_r: int = 16) -> None:
    """pool[rows[i]] = data[i]: data [n, B] uint8 on the device, pool [rows, B] uint8 (CUDA: pinned, mapped),
    rows [n] on the device; B a multiple of 4 (rows move as 32-bit words)."""
    require(data)
    n, B = data.shape
    if B % 4 or pool.shape[1] != B:
        raise ValueError(f"row_bytes: data ({B}) and pool ({pool.shape[1]}) rows must match and be whole words")
    if n:
        W = B // 4
        launch(_backup_kernel, (triton.cdiv(n, block_r),), data.contiguous().view(torch.int32), pool.view(torch.int32),
                                                   rows.contiguous(), n, W=W, BLOCK_R=block_r,
                                                   BLOCK_W=next_pow2(W))

