"""Indexer scoring for decode in Triton: every query row's scores over its own request's keys in the paged key
store, with the rounding of `indexer.index_scores` (every product and sum rounded on its own, d then h summed
left to right, no fused multiply-add), so the exact top-k that follows (`indexer.select_topk`: score desc,
position asc) selects what the torch path and the CPU kernel select, ties included.

One program per (query row, block of key positions); keys are read through the page table, no [S, L, dI]
gather. Scores are in the queries' dtype; keys past a row's visible count score -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...gpu_working_set.kernels.triton_support import require
from ..indexer import select_topk

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _index_scores_kernel(
        q_ptr, q_s0, q_s1, wr_ptr, wr_s0,               # q [n, HI, dI] (last dim contiguous), wr [n, HI]
        keys_ptr, keys_s0,                              # paged keys [rows, dI]
        table_ptr, table_s0, page_tokens,               # [S, pages] page ids
        seg_ptr, n_visible_ptr,                         # [n] each row's segment and visible key count
        out_ptr, out_s0, L,                             # scores [n, L]
        HI: tl.constexpr, DI: tl.constexpr, BLOCK_S: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    seg = tl.load(seg_ptr + t)
    visible = s < tl.load(n_visible_ptr + t)
    page = tl.load(table_ptr + seg * table_s0 + s // page_tokens, mask=visible, other=0)
    key = keys_ptr + (page * page_tokens + s % page_tokens).to(tl.int64) * keys_s0
    score = tl.zeros([BLOCK_S], q_ptr.dtype.element_ty)
    for h in range(HI):
        qh = q_ptr + t * q_s0 + h * q_s1
        dot = tl.load(qh) * tl.load(key, mask=visible, other=0.0)
        for d in range(1, DI):
            dot = dot + tl.load(qh + d) * tl.load(key + d, mask=visible, other=0.0)
        term = tl.load(wr_ptr + t * wr_s0 + h) * tl.maximum(dot, 0.0)
        score = tl.where(h == 0, term, score + term)      # the first head's term as is, as index_scores
    tl.store(out_ptr + t * out_s0 + s, tl.where(visible, score, _NEG_INF), mask=s < L)


def paged_scores(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, page_tokens: int,
                 seg: torch.Tensor, n_visible: torch.Tensor, max_visible: int, block_s: int = 128) -> torch.Tensor:
    """Scores [n, max_visible] of query rows q [n, HI, dI] with head weights wr [n, HI] (already scaled,
    `Indexer.head_weights`) over keys [rows, dI] (key j of segment s at row table[s, j // P] * P + j % P); row t
    sees keys 0 .. n_visible[t] - 1, the rest score -inf. Same bits as `indexer.index_scores`."""
    require(q)
    n, HI, dI = q.shape
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    table = table if table.stride(1) == 1 else table.contiguous()
    out = torch.empty(n, max_visible, dtype=q.dtype, device=q.device)
    if n and max_visible:
        _index_scores_kernel[(n, triton.cdiv(max_visible, block_s))](
            q, q.stride(0), q.stride(1), wr.to(q.dtype).contiguous(), HI, keys.to(q.dtype), keys.stride(0),
            table, table.stride(0), page_tokens, seg.contiguous(), n_visible.contiguous(), out, out.stride(0),
            max_visible, HI=HI, DI=dI, BLOCK_S=block_s, enable_fp_fusion=False)
    return out


def paged_topk_triton(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                      page_tokens: int, seg: torch.Tensor, n_visible: torch.Tensor, max_visible: int, k: int
                      ) -> torch.Tensor:
    """Exact top-k [n, k] (positions ascending, -1 padded) of `paged_scores`: `indexer.paged_topk`'s selections."""
    cols = select_topk(paged_scores(q, wr, keys, table, page_tokens, seg, n_visible, max_visible), k)
    return torch.nn.functional.pad(cols, (0, k - cols.shape[1]), value=-1)


def aot_source(heads: int = 64, head_dim: int = 128, block_s: int = 128) -> triton.compiler.ASTSource:
    """The scoring kernel for fp32 queries at full size (ML4's 64 indexer heads of 128), for AOT compilation."""
    sig = {"q_ptr": "*fp32", "q_s0": "i64", "q_s1": "i64", "wr_ptr": "*fp32", "wr_s0": "i64", "keys_ptr": "*fp32",
           "keys_s0": "i64", "table_ptr": "*i64", "table_s0": "i64", "page_tokens": "i32", "seg_ptr": "*i64",
           "n_visible_ptr": "*i64", "out_ptr": "*fp32", "out_s0": "i64", "L": "i32"}
    const = {"HI": heads, "DI": head_dim, "BLOCK_S": block_s}
    return triton.compiler.ASTSource(fn=_index_scores_kernel, signature=sig | dict.fromkeys(const, "constexpr"),
                                     constexprs=const)
