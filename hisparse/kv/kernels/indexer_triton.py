"""Indexer scoring for decode in Triton: every query row's scores over its own request's keys in the paged key
store, with the rounding of `indexer.index_scores` (every product and sum rounded on its own, d then h summed
left to right, no fused multiply-add), so the exact top-k that follows (`topk_triton.topk_rows`, the rule of
`indexer.select_topk`: score desc, position asc) selects what the torch path and the CPU kernel select, ties
included.

One program per (query row, block of key positions); keys are read through the page table, no [S, L, dI]
gather. Scores are in `indexer.score_dtype` of the queries' dtype (fp32 for fp32, bf16 and fp16 queries, fp64 for
fp64): queries, head weights and keys are converted to it as they are loaded (exact), and every product and sum
is taken in it. Keys past a row's visible count score -inf. Keys are plain [rows, dI] (the store's dtype), or the
fp8 index cache's records [rows, dI + 4] uint8 (`kv.index_cache`), decoded in the kernel: e4m3 times the
record's power-of-two scale, exact, so the scores are those of the dequantised keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.triton_support import launch, require
from ..scoring import score_dtype
from .sparse_mla_triton import e4m3_to_f32
from .topk_triton import topk_rows

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _index_scores_kernel(
        q_ptr, q_s0, q_s1, wr_ptr, wr_s0,               # q [n, HI, dI] (last dim contiguous), wr [n, HI]
        keys_ptr, keys_s0,                              # paged keys [rows, dI] (FP8: records [rows, dI + 4] u8)
        scale_ptr,                                      # FP8: the records as fp32 [rows, (dI + 4) / 4]
        table_ptr, table_s0, page_tokens,               # [S, pages] page ids
        seg_ptr, n_visible_ptr,                         # [n] each row's segment and visible key count
        out_ptr, out_s0, L,                             # scores [n, L] in the score dtype
        HI: tl.constexpr, DI: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    seg = tl.load(seg_ptr + t)
    visible = s < tl.load(n_visible_ptr + t)
    page = tl.load(table_ptr + seg * table_s0 + s // page_tokens, mask=visible, other=0)
    row = (page * page_tokens + s % page_tokens).to(tl.int64)
    key = keys_ptr + row * keys_s0
    sdt = out_ptr.dtype.element_ty                     # the score dtype: every value below is converted to it
    if FP8:
        scale = tl.load(scale_ptr + row * (keys_s0 // 4) + DI // 4, mask=visible, other=0.0)
    score = tl.zeros([BLOCK_S], sdt)
    for h in range(HI):
        qh = q_ptr + t * q_s0 + h * q_s1
        if FP8:   # e4m3 x a power of two: exact in fp32 and fp64
            k = (e4m3_to_f32(tl.load(key, mask=visible, other=0).to(tl.int32)) * scale).to(sdt)
            dot = tl.load(qh).to(sdt) * k
            for d in range(1, DI):
                k = (e4m3_to_f32(tl.load(key + d, mask=visible, other=0).to(tl.int32)) * scale).to(sdt)
                dot = dot + tl.load(qh + d).to(sdt) * k
        else:
            dot = tl.load(qh).to(sdt) * tl.load(key, mask=visible, other=0.0).to(sdt)
            for d in range(1, DI):
                dot = dot + tl.load(qh + d).to(sdt) * tl.load(key + d, mask=visible, other=0.0).to(sdt)
        term = tl.load(wr_ptr + t * wr_s0 + h).to(sdt) * tl.maximum(dot, 0.0)
        score = tl.where(h == 0, term, score + term)      # the first head's term as is, as index_scores
    tl.store(out_ptr + t * out_s0 + s, tl.where(visible, score, _NEG_INF), mask=s < L)


def paged_scores(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, page_tokens: int,
                 seg: torch.Tensor, n_visible: torch.Tensor, max_visible: int, block_s: int = 128) -> torch.Tensor:
    """Scores [n, max_visible] (in score_dtype(q.dtype)) of query rows q [n, HI, dI] with head weights wr [n, HI]
    (already scaled, `Indexer.head_weights`) over keys [rows, dI] (key j of segment s at row
    table[s, j // P] * P + j % P), or fp8 key records [rows, dI + 4] uint8 (scored as their dequantised keys); row
    t sees keys 0 .. n_visible[t] - 1, the rest score -inf. Same bits as `indexer.index_scores` (of the
    dequantised keys)."""
    require(q)
    n, HI, dI = q.shape
    fp8 = keys.dtype == torch.uint8
    if fp8 and (keys.shape[1] != dI + 4 or dI % 4):
        raise ValueError(f"paged_scores: fp8 key records must be [rows, {dI + 4}] with dI % 4 == 0, not "
                         f"{list(keys.shape)}")
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys.contiguous() if fp8 else keys
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    table = table if table.stride(1) == 1 else table.contiguous()
    sd = score_dtype(q.dtype)
    out = torch.empty(n, max_visible, dtype=sd, device=q.device)
    if n and max_visible:
        scales = keys.view(torch.float32) if fp8 else keys
        launch(_index_scores_kernel, (n, triton.cdiv(max_visible, block_s)),
            q, q.stride(0), q.stride(1), wr.to(sd).contiguous(), HI, keys, keys.stride(0), scales,
            table, table.stride(0), page_tokens, seg.contiguous(), n_visible.contiguous(), out, out.stride(0),
            max_visible, HI=HI, DI=dI, BLOCK_S=block_s, FP8=fp8, enable_fp_fusion=False)
    return out


def paged_topk_triton(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                      page_tokens: int, seg: torch.Tensor, n_visible: torch.Tensor, max_visible: int, k: int,
                      with_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact top-k (positions ascending, -1 padded) of `paged_scores`, as `indexer.paged_topk` returns it: cols
    [n, k] and with_scores their scores [n, k] (-inf padded, in score_dtype(q.dtype))."""
    scores = paged_scores(q, wr, keys, table, page_tokens, seg, n_visible, max_visible)          # [n, L]
    cols = topk_rows(scores, k)
    if not with_scores:
        return cols, None
    return cols, scores.gather(1, cols.clamp(min=0)).masked_fill(cols < 0, float("-inf"))

