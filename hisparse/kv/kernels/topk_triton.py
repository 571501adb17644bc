"""Exact top-k of score rows in Triton (radix select), the selection rule of `indexer.select_topk`: score
descending, ties by position ascending, -inf never selected; positions returned ascending, -1 padded.

One program per row. Scores map to integer keys whose order is the scores' order (-0.0 counts as +0.0, as a
sort compares them); `BITS / 8` passes over the row each fix the next 8 bits of the k-th largest key T with a
256-bin histogram of the keys that still match the prefix; a last pass writes, in position order, every key
> T and the first (k - #(> T)) keys == T. Reads the row BITS / 8 + 1 times, no sort: O(L) per row against
O(L log L) for a sorting top-k, and no [n, L] index tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.triton_support import launch, require

BLOCK = 128
_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _keys(x, BITS: tl.constexpr):
    """(u, s): u the key's bits as radix digits (unsigned order), s a signed int64 in the same order."""
    if BITS == 32:
        b = (x + 0.0).to(tl.int32, bitcast=True)                    # + 0.0: -0.0 becomes +0.0
        key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
        u = key.to(tl.int64) + 2147483648
        return u, u
    else:
        b = (x + 0.0).to(tl.int64, bitcast=True)
        key = tl.where(b >= 0, b, b ^ 0x7FFFFFFFFFFFFFFF)
        return key ^ (-9223372036854775807 - 1), key


@triton.jit
def _topk_kernel(scores_ptr, s_s0, L, k, out_ptr, out_s0, BITS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    row = scores_ptr + t.to(tl.int64) * s_s0
    out = out_ptr + t.to(tl.int64) * out_s0
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    high = tl.zeros([], tl.int64)          # the digits fixed so far, as a mask
    remaining = tl.zeros([], tl.int64) + k
    all_valid = tl.zeros([], tl.int64)   # 1: at most k valid keys, all of them are taken
    for p in tl.static_range(BITS // 8):
        shift = BITS - 8 * (p + 1)
        hist = tl.zeros([256], tl.int64)
        for s0 in range(0, L, BLOCK):
            j = s0 + tl.arange(0, BLOCK)
            x = tl.load(row + j, mask=j < L, other=_NEG_INF)
            u, s = _keys(x, BITS)
            match = (x != _NEG_INF) & ((u & high) == prefix)
            digit = (u >> shift) & 255
            hist += tl.sum(((digit[:, None] == bins[None, :]) & match[:, None]).to(tl.int64), axis=0)
        if p == 0:
            all_valid = (tl.sum(hist, axis=0) <= remaining).to(tl.int64)
        ge = tl.cumsum(hist, axis=0, reverse=True)           # keys with this digit or a larger one
        d = tl.max(tl.where(ge >= remaining, bins, 0), axis=0)
        remaining -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
        prefix = prefix | (d.to(tl.int64) << shift)
        high = high | (tl.full([], 255, tl.int64) << shift)
    if BITS == 32:                                           # the k-th largest key, as `_keys`'s s
        t_s = prefix
    else:
        t_s = prefix ^ (-9223372036854775807 - 1)
    n_out = tl.zeros([], tl.int64)
    eq_seen = tl.zeros([], tl.int64)
    for s0 in range(0, L, BLOCK):
        j = s0 + tl.arange(0, BLOCK)
        x = tl.load(row + j, mask=j < L, other=_NEG_INF)
        valid = x != _NEG_INF
        _, s = _keys(x, BITS)
        eq = valid & (s == t_s)
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int64), axis=0) - 1
        take = valid & ((all_valid + (s > t_s).to(tl.int64) + (eq & (eq_rank < remaining)).to(tl.int64)) > 0)
        idx = n_out + tl.cumsum(take.to(tl.int64), axis=0) - 1
        tl.store(out + idx, j.to(tl.int64), mask=take)
        n_out += tl.sum(take.to(tl.int64), axis=0)
        eq_seen += tl.sum(eq.to(tl.int64), axis=0)
    for c0 in range(0, k, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        tl.store(out + c, tl.full([BLOCK], -1, tl.int64), mask=(c >= n_out) & (c < k))


def topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """select_topk(scores, k) padded to k columns: scores [n, L] (fp32 or fp64) -> positions [n, k] ascending,
    -1 padded."""
    require(scores)
    if scores.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"topk_rows: fp32 or fp64 scores, not {scores.dtype}")
    n, L = scores.shape
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    out = torch.empty(n, k, dtype=torch.long, device=scores.device)
    if n and k:
        launch(_topk_kernel, (n,), scores, scores.stride(0), L, k, out, out.stride(0),
                           BITS=8 * scores.element_size(), BLOCK=BLOCK)
    return out

