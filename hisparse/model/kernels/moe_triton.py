"""Routed experts as two grouped GEMMs (Triton), with static shapes and no host synchronisation.

The torch path of `MoE` runs one SwiGLU per expert over the tokens routed to it; it needs the per-expert token
counts on the host (`.tolist()`), a sync per MoE layer, and launches 3 matmuls per expert (128 experts x 64
layers per step at full size). Here, as vLLM's fused_moe does it:
- `align` groups the (token, slot) pairs by expert on the device, each expert's group padded to whole BLOCK_M
  blocks: `pairs` [P_max] (pair index t * top_k + j, or -1) and the expert of every block (-1: unused block).
  P_max = N top_k + E_local (BLOCK_M - 1) bounds every routing, so every shape is known before routing.
- `_gate_up_kernel`: per (block, hidden tile): silu(x W1^T) * (x W3^T) for the block's pairs -> `inter`.
- `_down_kernel`: per (block, model-dim tile): (inter W2^T) * gate -> the pair's own output row.
The caller sums each token's top_k rows in slot order. Weights are the experts' own, stacked [E_local, out, in]
(plain, or FP8 e4m3 with per-(B0 x B1)-block fp32 scales, dequantised in the kernel); products accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.triton_support import launch, require
from ...kv.kernels.sparse_mla_triton import e4m3_to_f32

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


def align(ids: torch.Tensor, first: int, n_local: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, k] (global expert ids) -> pairs [P_max] (pair index, -1 pad) grouped by local expert (first ..
    first + n_local - 1; other experts' pairs are dropped), each group padded to block_m, and block_expert
    [P_max / block_m] (local expert of each block, -1 unused). Device ops only."""
    flat = ids.flatten()
    P = flat.numel()
    p_max = -(-(P + n_local * (block_m - 1)) // block_m) * block_m
    local = flat - first
    key = torch.where((local >= 0) & (local < n_local), local, n_local)          # n_local: dropped
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))                                             # [n_local + 1] (bincount syncs)
    padded = (counts + block_m - 1) // block_m * block_m                          # last (dropped): reaches nothing
    ends = torch.cumsum(padded, 0)                                                # group ends, padded
    order = torch.argsort(key, stable=True)                                       # pairs by expert, in order
    skey = key[order]
    rank = torch.arange(P, device=ids.device) - (torch.cumsum(counts, 0) - counts)[skey]
    dest = torch.where(skey < n_local, (ends - padded)[skey] + rank, p_max)       # p_max: a discarded slot
    pairs = torch.full((p_max + 1,), -1, dtype=torch.long, device=ids.device).scatter_(0, dest, order)[:p_max]
    starts = torch.arange(0, p_max, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends[:n_local], starts, right=True)
    return pairs, torch.where(block_expert < n_local, block_expert, -1)


@triton.jit
def _load_w(w_ptr, s_ptr, e, n, kk, OUT, IN, NB1, nm, km, FP8: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr):
    """Tile [BLOCK_N, BLOCK_K] of expert e's weight [OUT, IN] in fp32 (FP8: e4m3 bytes times their block
    scales)."""
    m = nm[:, None] & km[None, :]
    raw = tl.load(w_ptr + e.to(tl.int64) * OUT * IN + n[:, None] * IN + kk[None, :], mask=m, other=0)
    if FP8:
        nb0 = (OUT + B0 - 1) // B0
        s = tl.load(s_ptr + (e.to(tl.int64) * nb0 + n[:, None] // B0) * NB1 + kk[None, :] // B1, mask=m, other=0.0)
        w = e4m3_to_f32(raw.to(tl.int32) & 0xFF) * s
    else:
        w = raw.to(tl.float32)
    return w


@triton.jit
def _block(pairs_ptr, b, pn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block b's padded rows m, their pairs (-1: padding) and the output columns n of column tile pn."""
    m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    return m, tl.load(pairs_ptr + m), pn * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _gate_up_kernel(x_ptr, pairs_ptr, bexp_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, inter_ptr, D, HID, TOPK,
                    NB1, FP8: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b, pn = tl.program_id(0), tl.program_id(1)
    e = tl.load(bexp_ptr + b)
    if e >= 0:
        m, pair, n = _block(pairs_ptr, b, pn, BLOCK_M, BLOCK_N)
        tok = tl.where(pair >= 0, pair // TOPK, 0)
        nm = n < HID
        a1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < D
            x = tl.load(x_ptr + tok[:, None].to(tl.int64) * D + kk[None, :], mask=(pair[:, None] >= 0) & km[None, :],
                        other=0.0).to(tl.float32)
            w1 = _load_w(w1_ptr, s1_ptr, e, n, kk, HID, D, NB1, nm, km, FP8, B0, B1)
            w3 = _load_w(w3_ptr, s3_ptr, e, n, kk, HID, D, NB1, nm, km, FP8, B0, B1)
            a1 += tl.dot(x, tl.trans(w1), input_precision="ieee")
            a3 += tl.dot(x, tl.trans(w3), input_precision="ieee")
        h = a1 / (1.0 + tl.exp(-a1)) * a3
        tl.store(inter_ptr + m[:, None].to(tl.int64) * HID + n[None, :], h, mask=nm[None, :])


@triton.jit
def _down_kernel(inter_ptr, pairs_ptr, bexp_ptr, gate_ptr, w2_ptr, s2_ptr, out_ptr, D, HID, NB1,
                 FP8: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b, pn = tl.program_id(0), tl.program_id(1)
    e = tl.load(bexp_ptr + b)
    if e >= 0:
        m, pair, n = _block(pairs_ptr, b, pn, BLOCK_M, BLOCK_N)
        valid = pair >= 0
        nm = n < D
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, HID, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < HID
            h = tl.load(inter_ptr + m[:, None].to(tl.int64) * HID + kk[None, :], mask=km[None, :], other=0.0)
            w2 = _load_w(w2_ptr, s2_ptr, e, n, kk, D, HID, NB1, nm, km, FP8, B0, B1)
            acc += tl.dot(h, tl.trans(w2), input_precision="ieee")
        g = tl.load(gate_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
        tl.store(out_ptr + tl.where(valid, pair, 0)[:, None].to(tl.int64) * D + n[None, :], acc * g[:, None],
                 mask=valid[:, None] & nm[None, :])


class StackedExperts:
    """One MoE layer's local experts as stacked weights: w1, w3 [E, HID, D], w2 [E, D, HID] (and their block
    scales for FP8), in the experts' own dtype."""

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, scales: tuple | None = None,
                 block: tuple[int, int] | None = None):
        self.w1, self.w3, self.w2, self.scales, self.block = w1, w3, w2, scales, block

    @property
    def fp8(self) -> bool:
        return self.scales is not None


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, experts: StackedExperts,
                    first: int) -> torch.Tensor:
    """sum_j gates[t, j] SwiGLU_{ids[t, j]}(x[t]) over the slots whose expert is local (first .. first + E - 1):
    x [N, D], ids / gates [N, k] -> [N, D] in x's dtype."""
    require(x)
    N, D = x.shape
    k = ids.shape[1]
    E, HID = experts.w1.shape[0], experts.w1.shape[1]
    pairs, bexp = align(ids, first, E)
    x = x.contiguous()
    inter = torch.zeros(pairs.numel(), HID, dtype=torch.float32, device=x.device)
    out = torch.zeros(N * k, D, dtype=torch.float32, device=x.device)
    fp8 = experts.fp8
    b0, b1 = experts.block if fp8 else (1, 1)
    s1, s3, s2 = experts.scales if fp8 else (out, out, out)         # unread without FP8
    w1, w3, w2 = ((w.view(torch.uint8) for w in (experts.w1, experts.w3, experts.w2)) if fp8
                  else (experts.w1, experts.w3, experts.w2))
    nb_d, nb_h = -(-D // b1), -(-HID // b1)
    if N and bexp.numel():
        launch(_gate_up_kernel, (bexp.numel(), triton.cdiv(HID, BLOCK_N)),
            x, pairs, bexp, w1, s1, w3, s3, inter, D, HID, k, nb_d, FP8=fp8, B0=b0, B1=b1,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        launch(_down_kernel, (bexp.numel(), triton.cdiv(D, BLOCK_N)),
            inter, pairs, bexp, gates.float().contiguous().flatten(), w2, s2, out, D, HID, nb_h, FP8=fp8,
            B0=b0, B1=b1, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.view(N, k, D).sum(1).to(x.dtype)

