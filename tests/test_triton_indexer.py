"""The Triton indexer scoring kernel against the torch path: the same score bits as `index_scores` (fp32 and fp64
queries, and bf16 and fp16 queries scored in fp32, `score_dtype`), so the exact top-k selects what `paged_topk`
selects, near-ties and exact ties included. Without CUDA the kernel runs under Triton's interpreter
(tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hisparse.core import triton_support
from hisparse.kv.scoring import index_scores, paged_topk, score_dtype

pytestmark = pytest.mark.skipif(
    not (triton_support.available() and (torch.cuda.is_available() or triton_support.interpreted())),
    reason="needs triton, and CUDA or the Triton interpreter (TRITON_INTERPRET=1 before triton is imported)")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Topk:
    """What paged_topk needs of an Indexer: head_weights (identity here: wr given) and topk."""

    def __init__(self, k: int):
        self.topk, self.n_heads = k, 3

    def head_weights(self, w: torch.Tensor) -> torch.Tensor:
        return w


def paged_case(g: torch.Generator, dtype: torch.dtype, ties: bool):
    n, HI, dI, P, S = 5, 3, 8, 4, 3
    lengths = torch.tensor([1, 9, 23])
    n_pages = 6
    table = torch.stack([torch.randperm(S * n_pages, generator=g)[:n_pages] for _ in range(S)])
    keys = torch.randn(S * n_pages * P, dI, generator=g, dtype=dtype)
    if ties:     # whole-key duplicates (exact ties) and keys a rounding step apart (near-ties)
        keys[1::3] = keys[0:-1:3]
        keys[2::5] = keys[2::5] * (1 + torch.finfo(dtype).eps)
    q = torch.randn(n, HI, dI, generator=g, dtype=dtype)
    wr = torch.rand(n, HI, generator=g, dtype=dtype) - 0.2
    seg = torch.tensor([0, 1, 1, 2, 2])
    n_visible = torch.minimum(lengths[seg], torch.tensor([1, 4, 9, 17, 23]))
    return q, wr, keys, table, P, seg, n_visible, int(lengths.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ties", [False, True])
def test_scores_bit_identical_and_same_selection(dtype: torch.dtype, ties: bool, seed: int) -> None:
    from hisparse.kv.kernels.indexer_triton import paged_scores, paged_topk_triton
    g = torch.Generator().manual_seed(seed)
    q, wr, keys, table, P, seg, n_visible, L = paged_case(g, dtype, ties)
    j = torch.arange(L)
    per_row = keys[table[seg][:, j // P] * P + j % P]                                   # [n, L, dI]
    ref = index_scores(q, wr, per_row, n_visible - 1)
    assert ref.dtype == score_dtype(dtype)
    sd = ref.dtype   # the definition: the inputs converted to the score dtype, then scored in it
    assert torch.equal(index_scores(q.to(sd), wr.to(sd), per_row.to(sd), n_visible - 1), ref)
    d = lambda t: t.to(DEV)    # noqa: E731
    got = paged_scores(d(q), d(wr), d(keys), d(table), P, d(seg), d(n_visible), L, block_s=8).cpu()
    assert got.dtype == sd and torch.equal(got, ref)
    for k in (4, 30):   # the selections, and with_scores (DCP's local candidates) their score bits
        cols, scores = paged_topk(Topk(k), q, wr, keys, table, P, seg, n_visible, L, with_scores=True)
        got, got_scores = paged_topk_triton(d(q), d(wr), d(keys), d(table), P, d(seg), d(n_visible), L, k,
                                            with_scores=True)
        assert torch.equal(got.cpu(), cols) and torch.equal(got_scores.cpu(), scores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fp8_records_score_as_their_dequantised_keys(dtype: torch.dtype, seed: int) -> None:
    """Keys stored as the fp8 index cache's 132-B-style records, decoded in the kernel: the score bits of the
    dequantised keys (torch path), and paged_topk's selections; differs from the exact keys' scores."""
    from hisparse.kv.index_cache import dequantise, quantise
    from hisparse.kv.kernels.indexer_triton import paged_scores, paged_topk_triton
    g = torch.Generator().manual_seed(seed)
    q, wr, keys, table, P, seg, n_visible, L = paged_case(g, dtype, ties=True)
    keys = keys * torch.logspace(-3, 2, keys.shape[0], dtype=dtype)[:, None]     # scales across many powers of two
    rec = quantise(keys)
    deq = dequantise(rec, score_dtype(dtype))
    j = torch.arange(L)
    ref = index_scores(q, wr, deq[table[seg][:, j // P] * P + j % P], n_visible - 1)
    d = lambda t: t.to(DEV)    # noqa: E731
    got = paged_scores(d(q), d(wr), d(rec), d(table), P, d(seg), d(n_visible), L, block_s=8).cpu()
    assert torch.equal(got, ref)
    assert not torch.equal(got, paged_scores(d(q), d(wr), d(keys), d(table), P, d(seg), d(n_visible), L,
                                             block_s=8).cpu())
    for k in (4, 30):
        cols, _ = paged_topk(Topk(k), q, wr, deq, table, P, seg, n_visible, L)
        assert torch.equal(paged_topk_triton(d(q), d(wr), d(rec), d(table), P, d(seg), d(n_visible), L,
                                             k)[0].cpu(), cols)
    with pytest.raises(ValueError, match="fp8 key records"):
        paged_scores(d(q), d(wr), d(rec[:, :-1]), d(table), P, d(seg), d(n_visible), L)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("L, k", [(1, 1), (5, 8), (37, 8), (128, 128), (300, 16), (260, 64)])
def test_radix_topk_is_select_topk(dtype: torch.dtype, L: int, k: int, seed: int) -> None:
    """The Triton radix select against the stable-sort top-k: random rows, rows of ties (equal scores, +0.0 and
    -0.0, rounded values), rows with few or no visible keys, L below, at and above the block and k."""
    from hisparse.kv.scoring import select_topk
    from hisparse.kv.kernels.topk_triton import topk_rows
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(7, L, generator=g, dtype=dtype) * 10 ** torch.randint(-3, 4, (7, 1), generator=g).to(dtype)
    s[0, ::3] = 0.5
    s[1] = 0.0
    s[1, ::2] = -0.0
    s[2, L // 2:] = float("-inf")
    s[3] = float("-inf")
    s[4] = torch.round(s[4] * 2) / 2
    s[5, 1:] = s[5, 0]
    want = torch.nn.functional.pad(select_topk(s, k), (0, k - min(k, L)), value=-1)
    assert torch.equal(topk_rows(s.to(DEV), k).cpu(), want)
