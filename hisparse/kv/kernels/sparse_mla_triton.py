"""Sparse MLA decode in Triton: absorbed attention of every query row over its own top-k stored rows, read
straight from the byte store (the arena or a paged store) and dequantised inside the kernel.

Layouts (`host_pool.layout.RowLayout`): fp8_ds_mla (r x fp8 e4m3 || r / tile x fp32 tile scales || dR x bf16
rope: 656 B at full size) and bf16 ((r + dR) x bf16). One program per (query row, block of heads) streams its
k rows in tiles with an online softmax and returns the latent output and the log-sum-exp (what decode context
parallelism combines partials with); SSMax's per-head query gain can be applied inside (q * g). The reference is
`kv.sparse_mla` over `RowLayout.gather_unpack` rows: they agree within fp32 rounding (the kernel sums in
another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.triton_support import launch, next_pow2, require
from ...host_pool.layout import RowLayout

_FP8 = tl.constexpr(0)
_BF16 = tl.constexpr(1)
_LAYOUTS = {"fp8_ds_mla": 0, "bf16": 1}
# heads per program: 16, the least tl.dot takes. The fp32 dots stage [heads, r] and [r, k-tile] operands in shared
# memory: at r = 512, 16 heads need ~201 KiB of sm_90's 227 KiB per block (32 heads: ~237 KiB, no launch)
BLOCK_H = 16
_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def e4m3_to_f32(b):
    """fp8 e4m3fn byte (int32 0..255) -> its exact fp32 value (no inf; S.1111.111 is NaN)."""
    sign = (b & 0x80) << 24
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = (sign | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125            # exp 0: man x 2^-9
    sub = tl.where(sign != 0, -sub, sub)
    val = tl.where(exp == 0, sub, normal)
    nan = (sign | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, nan, val)


@triton.jit
def _bf16_to_f32(h):
    """bf16 bits (int16 as loaded) -> fp32."""
    return ((h.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_rows(u8, f32, i16, valid, col, rope_col,
               B: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, TILE: tl.constexpr, LAYOUT: tl.constexpr):
    """Decoded c [BLOCK_K, BLOCK_R] and k_rope [BLOCK_K, BLOCK_DR] of the stored rows starting at the byte, word
    and half-word pointers u8, f32, i16 [BLOCK_K] (fp32, 0 where invalid)."""
    cm = valid[:, None] & (col[None, :] < R)
    rm = valid[:, None] & (rope_col[None, :] < DR)
    if LAYOUT == _FP8:
        byte = tl.load(u8[:, None] + col[None, :], mask=cm, other=0).to(tl.int32)
        sc = tl.load(f32[:, None] + R // 4 + col[None, :] // TILE, mask=cm, other=0.0)
        c = e4m3_to_f32(byte) * sc
        rope_at = (R + 4 * (R // TILE)) // 2
        rope = _bf16_to_f32(tl.load(i16[:, None] + rope_at + rope_col[None, :], mask=rm, other=0))
    else:
        c = _bf16_to_f32(tl.load(i16[:, None] + col[None, :], mask=cm, other=0))
        rope = _bf16_to_f32(tl.load(i16[:, None] + R + rope_col[None, :], mask=rm, other=0))
    return tl.where(cm, c, 0.0), tl.where(rm, rope, 0.0)


@triton.jit
def _sparse_mla_kernel(
        q_ptr, q_s0, q_s1, qr_ptr, qr_s0, qr_s1, gain_ptr, g_s0,     # q_lat [n, H, r], q_rope [n, H, dR], gain [n, H]
        idx_ptr, idx_s0, k, H, scale,                              # idx [n, k] rows (-1: none)
        u8_ptr, f32_ptr, i16_ptr, n_store,                         # store [n_store, B] and its word views
        xu8_ptr, xf32_ptr, xi16_ptr,                               # extra rows (idx >= n_store: idx - n_store)
        out_ptr, lse_ptr,                                          # [n, H, r] fp32, [n, H] fp32
        B: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, TILE: tl.constexpr, LAYOUT: tl.constexpr,
        HAS_ROPE: tl.constexpr, HAS_GAIN: tl.constexpr, HAS_EXTRA: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col = tl.arange(0, BLOCK_R)
    rope_col = tl.arange(0, BLOCK_DR)
    hm = h < H
    q = tl.load(q_ptr + t * q_s0 + h[:, None] * q_s1 + col[None, :], mask=hm[:, None] & (col[None, :] < R),
                other=0.0).to(tl.float32)                                                  # [BH, BR]
    if HAS_ROPE:
        qr = tl.load(qr_ptr + t * qr_s0 + h[:, None] * qr_s1 + rope_col[None, :],
                     mask=hm[:, None] & (rope_col[None, :] < DR), other=0.0).to(tl.float32)       # [BH, BDR]
    else:
        qr = tl.zeros([BLOCK_H, BLOCK_DR], tl.float32)
    if HAS_GAIN:
        g = tl.load(gain_ptr + t * g_s0 + h, mask=hm, other=0.0).to(tl.float32)
        q = q * g[:, None]
        qr = qr * g[:, None]
    m_i = tl.full([BLOCK_H], _NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        row = tl.load(idx_ptr + t * idx_s0 + kk, mask=kk < k, other=-1)
        valid = row >= 0
        r = tl.where(valid, row, 0)
        u8, f32, i16 = u8_ptr + r * B, f32_ptr + r * (B // 4), i16_ptr + r * (B // 2)
        if HAS_EXTRA:      # one load of each row from wherever it is: the store or this step's extra rows
            x = row >= n_store
            xr = tl.maximum(row - n_store, 0)
            u8 = tl.where(x, xu8_ptr + xr * B, u8)
            f32 = tl.where(x, xf32_ptr + xr * (B // 4), f32)
            i16 = tl.where(x, xi16_ptr + xr * (B // 2), i16)
        c, rope = _load_rows(u8, f32, i16, valid, col, rope_col, B, R, DR, TILE, LAYOUT)
        s = tl.dot(q, tl.trans(c), input_precision="ieee")                                # [BH, BK]
        if HAS_ROPE:
            s += tl.dot(qr, tl.trans(rope), input_precision="ieee")
        s = tl.where(valid[None, :], s * scale, _NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)        # no valid row yet: keep everything at zero
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptr + (t * H + h[:, None]) * R + col[None, :], out, mask=hm[:, None] & (col[None, :] < R))
    tl.store(lse_ptr + t * H + h, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), _NEG_INF), mask=hm)


def _views(store: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return store, store.view(torch.float32), store.view(torch.int16)


def sparse_mla_rows(q_lat: torch.Tensor, q_rope: torch.Tensor | None, store: torch.Tensor, idx: torch.Tensor,
                    layout: RowLayout, scale: float, gain: torch.Tensor | None = None,
                    extra: torch.Tensor | None = None, block_k: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA of q_lat [n, H, r] (q_rope [n, H, dR] or None: NoPE) over the rows idx [n, k] (-1: none) of
    store [rows, row_bytes] uint8 (an idx >= rows reads extra[idx - rows]), optionally with the SSMax gain
    [n, H] applied to the queries -> olat [n, H, r], lse [n, H] in q_lat's dtype (lse -inf, olat 0 where a query
    has no row)."""
    require(q_lat)
    n, H, r = q_lat.shape
    k = idx.shape[1]
    B = layout.row_bytes
    if layout.name not in _LAYOUTS or store.dtype != torch.uint8 or store.shape[1] != B or r != layout.rank:
        raise ValueError(f"kv_layout: the kernel reads {list(_LAYOUTS)} byte rows of {B} B with rank {layout.rank}"
                         f" (store {tuple(store.shape)} {store.dtype}, rank {r})")
    q_lat = q_lat if q_lat.stride(2) == 1 else q_lat.contiguous()
    qr = q_rope if q_rope is None or q_rope.stride(2) == 1 else q_rope.contiguous()
    idx = idx if idx.stride(1) == 1 else idx.contiguous()
    out = torch.empty(n, H, r, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(n, H, dtype=torch.float32, device=q_lat.device)
    store = store.contiguous()
    gain = gain.contiguous() if gain is not None else None
    xs = extra.contiguous() if extra is not None else store
    if n and H:
        launch(_sparse_mla_kernel, (n, triton.cdiv(H, BLOCK_H)),
            q_lat, q_lat.stride(0), q_lat.stride(1),
            qr if qr is not None else q_lat, qr.stride(0) if qr is not None else 0,
            qr.stride(1) if qr is not None else 0,
            gain if gain is not None else q_lat, gain.stride(0) if gain is not None else 0,
            idx, idx.stride(0), k, H, float(scale), *_views(store), store.shape[0], *_views(xs), out, lse,
            B=B, R=r, DR=layout.rope_dim, TILE=layout.tile, LAYOUT=_LAYOUTS[layout.name],
            HAS_ROPE=qr is not None, HAS_GAIN=gain is not None, HAS_EXTRA=extra is not None,
            BLOCK_H=BLOCK_H, BLOCK_K=block_k, BLOCK_R=max(16, next_pow2(r)),
            BLOCK_DR=max(16, next_pow2(layout.rope_dim)))
    return out.to(q_lat.dtype), lse.to(q_lat.dtype)

