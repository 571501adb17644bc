"""Indexer scoring (spec §3.6): the exact top-k of query rows over cached keys, as every KV store selects.

Order is normative: score descending, ties by position ascending. Selections are returned as positions in
ascending order, padded with -1 where a query has fewer than k visible keys. Scores are computed in
`score_dtype(activation dtype)` (fp32 for fp32, bf16 and fp16 activations, fp64 for fp64) by every scorer: the
torch path here, the fused CPU kernel (kernels/indexer_topk.py) and the Triton kernel (kernels/indexer_triton.py).
The model's `Indexer` projects queries and keys; the stores score them here.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .index_cache import dequantise
from .kernels import indexer_topk


class Scorer(Protocol):
    """What scoring needs of an indexer layer (the model's `Indexer`)."""
    topk: int
    n_heads: int

    def head_weights(self, w: torch.Tensor) -> torch.Tensor:
        """w [T, HI] -> the scaled head weights in the score dtype."""


SCORE_BLOCK_ELEMS = 1 << 24   # bound on the [rows, HI, S] score temporaries of one block
FUSED_MIN_PAIRS = 1 << 12     # (query, key) pairs from which select uses the CPU kernel (faster at any size;
                              # smaller inputs keep the torch reference path in use, at < 1 ms a call)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype indexer scores are computed and returned in for activations of `dtype`: fp64 for fp64, else fp32
    (as the anchors' indexers score bf16 activations). Queries, head weights and keys convert to it exactly."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def index_scores(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_h wr[t,h] relu(<q[t,h], keys[s]>), -inf where s > p_t: [T, S] (q [T, HI, dI], wr [T, HI]).

    keys [S, dI] are shared by every row, or [T, S, dI] give each row its own (a batch of requests).
    The rounding is part of the contract, because exact ties decide selections: q, wr and keys are converted to
    score_dtype(q.dtype) (exact), then every product and sum is rounded on its own in it (no FMA, no GEMM
    blocking), d and h are summed left to right. So a score does not depend on S, on the device or on the
    scorer: the fused CPU kernel (kernels/indexer_topk.cpp) and the Triton kernel reproduce it bit for bit.
    """
    sd = score_dtype(q.dtype)
    q, wr, keys = q.to(sd), wr.to(sd), keys.to(sd)
    kt = keys.transpose(-1, -2)                                            # [dI, S] or [T, dI, S]
    col = (lambda d: kt[d]) if keys.dim() == 2 else (lambda d: kt[:, None, d])
    dots = q[:, :, 0, None] * col(0)                                       # [T, HI, S]
    for d in range(1, q.shape[2]):
        dots.add_(q[:, :, d, None] * col(d))
    dots.relu_()
    scores = wr[:, 0, None] * dots[:, 0]                                   # [T, S]
    for h in range(1, q.shape[1]):
        scores.add_(wr[:, h, None] * dots[:, h])
    s_idx = torch.arange(keys.shape[-2], device=keys.device)
    return scores.masked_fill_(s_idx[None, :] > positions[:, None], float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Exact stable top-k of each row of scores [T, S] (invisible keys = -inf).

    Returns [T, min(k, S)] selected positions, ascending, -1 padded. A stable descending sort keeps equal scores
    in position order, so its first k columns are exactly the normative top-k (score desc, position asc); fixed
    shapes throughout, no host synchronisation.
    """
    S = scores.shape[1]
    width = min(k, S)
    vals, cols = torch.sort(scores, dim=1, descending=True, stable=True)
    cols = torch.where(vals[:, :width] > float("-inf"), cols[:, :width], S)
    cols = torch.sort(cols, dim=1).values
    return cols.masked_fill(cols == S, -1)


def fused_keys(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, pairs: int) -> torch.Tensor | None:
    """keys as the fused CPU kernel takes them for q, wr in the score dtype (plain keys widened to it, exactly;
    fp8 records as they are), or None where the torch path scores: too few (query, key) pairs for the kernel to
    pay, inputs off the CPU, or no built kernel."""
    if pairs < FUSED_MIN_PAIRS or keys.device.type != "cpu" or not indexer_topk.available():
        return None
    keys = keys if indexer_topk.is_records(q, keys) else keys.to(q.dtype)
    return keys if indexer_topk.supports(q, wr, keys) else None


def paged_topk(indexer: Scorer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
               page_tokens: int, seg: torch.Tensor, n_visible: torch.Tensor, max_visible: int,
               with_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact top-k of a batch of query rows, each over its own request's keys in a paged store.

    q [n, HI, dI], w [n, HI], keys [rows, dI] (row = table[s, j // P] * P + j % P for key j of segment s) or the
    fp8 index cache's records [rows, dI + 4] uint8 (scored as their dequantised keys, `index_cache.dequantise`),
    seg [n], n_visible [n] (row t sees keys 0 .. n_visible[t] - 1), max_visible >= every n_visible (host int).
    Returns cols [n, k] (key indices ascending, -1 padded) and with_scores their scores [n, k] (-inf padded, in
    score_dtype(q.dtype)). CPU inputs go to the fused kernel in one call (it decodes records as it gathers them);
    elsewhere the torch path scores blocks of rows against their segment's keys gathered (and dequantised) into
    [S, L, dI]. Both give the selections of select_topk(index_scores(...)).
    """
    n, k = q.shape[0], indexer.topk
    sd = score_dtype(q.dtype)
    q, wr = q.to(sd), indexer.head_weights(w).to(sd)
    L = max_visible
    if n == 0 or L == 0:
        cols = torch.full((n, k), -1, dtype=torch.long, device=q.device)
        return cols, (q.new_full((n, k), float("-inf")) if with_scores else None)
    width = min(k, L)
    fused = fused_keys(q, wr, keys, n * L)
    if fused is not None:
        P = page_tokens
        cols, scores = indexer_topk.fused_topk_paged(q, wr, fused, table[:, : -(-L // P)], P, seg, n_visible, k,
                                                     with_scores)
    else:
        j = torch.arange(L, device=keys.device)
        per_seg = keys[table[:, j // page_tokens] * page_tokens + j % page_tokens]      # [S, L, dI (+ 4)]
        per_seg = dequantise(per_seg, sd) if indexer_topk.is_records(q, keys) else per_seg.to(sd)
        rows = max(1, SCORE_BLOCK_ELEMS // max(1, indexer.n_heads * L))
        cols, scores = [], []
        for i in range(0, n, rows):   # blocks of query rows bound the score memory
            s = index_scores(q[i:i + rows], wr[i:i + rows], per_seg[seg[i:i + rows]], n_visible[i:i + rows] - 1)
            c = select_topk(s, k)
            cols.append(c)
            if with_scores:
                scores.append(s.gather(1, c.clamp(min=0)).masked_fill(c < 0, float("-inf")))
        cols, scores = torch.cat(cols), (torch.cat(scores) if with_scores else None)
    if width < k:   # a context shorter than k: pad to the fixed width
        cols = torch.nn.functional.pad(cols[:, :width], (0, k - width), value=-1)
        if with_scores:
            scores = torch.nn.functional.pad(scores[:, :width], (0, k - width), value=float("-inf"))
    return cols, scores
