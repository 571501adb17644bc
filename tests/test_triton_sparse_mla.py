"""The Triton sparse MLA decode kernel against the torch path (`kv.sparse_mla` over `RowLayout.gather_unpack`
rows): latent output and LSE within fp32 rounding, for both byte layouts, NoPE, the SSMax gain, empty and
partial selections, transient rows read from a second store, k off the tile multiple, non-contiguous inputs; with
bf16 queries (the CUDA default), no farther from an fp64 reference than the torch path in bf16 is (within a small
factor). Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hisparse.core import triton_support
from hisparse.host_pool.layout import RowLayout
from hisparse.kv.base import sparse_mla

from lockstep import no_less_exact

pytestmark = pytest.mark.skipif(
    not (triton_support.available() and (torch.cuda.is_available() or triton_support.interpreted())),
    reason="needs triton, and CUDA or the Triton interpreter (TRITON_INTERPRET=1 before triton is imported)")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(q, qr, store, idx, layout, scale, gain=None, extra=None, dtype=torch.float32):
    """`sparse_mla` in `dtype` (queries, gain and decoded rows converted to it), as the torch store attends."""
    both = store if extra is None else torch.cat((store, extra))
    rows = layout.gather_unpack(both, idx.clamp(min=0), dtype)
    q, qr, gain = (None if t is None else t.to(dtype) for t in (q, qr, gain))
    if gain is not None:
        q, qr = q * gain[..., None], (qr * gain[..., None] if qr is not None else None)
    return sparse_mla(q, qr, rows, idx >= 0, scale, layout.rank)


def run(g, name, rank, rope, n, H, k, rows, *, nope=False, gain=False, extra_rows=0, empty_rows=(), block_k=16,
        dtype=torch.float32):
    """The kernel on random rows against the torch path. fp32 queries: within fp32 rounding. bf16 queries: both
    the kernel (fp32 inside, bf16 out) and the torch path in bf16 against `sparse_mla` in fp64 on the same
    inputs; the kernel's largest error at most twice the torch path's (which also rounds logits, weights and rows
    to bf16), or twice the error of rounding the fp64 result to bf16, which no bf16 output can avoid."""
    from hisparse.kv.kernels.sparse_mla_triton import sparse_mla_rows
    layout = RowLayout.create(name, rank, rope)
    r = lambda *s: torch.randn(*s, generator=g)   # noqa: E731
    store = layout.pack(r(rows, rank + rope) * 2)
    extra = layout.pack(r(extra_rows, rank + rope)) if extra_rows else None
    idx = torch.randint(0, rows + extra_rows, (n, k), generator=g)
    idx[torch.rand(n, k, generator=g) < 0.25] = -1
    for i in empty_rows:
        idx[i] = -1
    q, qr = r(n, H, rank) * 0.3, (None if nope else r(n, H, rope) * 0.3)
    gn = (torch.rand(n, H, generator=g) + 0.5) if gain else None
    q, qr, gn = (None if t is None else t.to(dtype) for t in (q, qr, gn))
    scale = (rank + rope) ** -0.5
    ref_o, ref_lse = reference(q, qr, store, idx, layout, scale, gn, extra, dtype)
    d = lambda t: None if t is None else t.to(DEV)    # noqa: E731
    o, lse = sparse_mla_rows(d(q), d(qr), d(store), d(idx), layout, scale, d(gn), d(extra), block_k=block_k)
    o, lse = o.cpu(), lse.cpu()
    assert o.dtype == lse.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        return o, lse
    exact_o, exact_lse = reference(q, qr, store, idx, layout, scale, gn, extra, torch.float64)
    assert no_less_exact(o, ref_o, exact_o) and no_less_exact(lse, ref_lse, exact_lse)
    return o, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["fp8_ds_mla", "bf16"])
def test_small_rows(name: str, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    run(g, name, 32, 16, n=3, H=5, k=21, rows=40, dtype=dtype)                      # k off the tile multiple
    run(g, name, 32, 8, n=2, H=3, k=7, rows=9, nope=True, gain=True, dtype=dtype)   # NoPE, SSMax gain, dR < 16
    o, lse = run(g, name, 64, 16, n=4, H=2, k=33, rows=30, extra_rows=12, empty_rows=(2,), block_k=32, dtype=dtype)
    assert torch.isneginf(lse[2]).all() and not o[2].any()             # nothing selected: lse -inf, output 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_size_fp8_row(dtype: torch.dtype, seed: int) -> None:
    """The 656-byte fp8_ds_mla row (r = 512, tiles of 128, dR = 64) with ML4's 128 heads in blocks of 64."""
    g = torch.Generator().manual_seed(seed)
    run(g, "fp8_ds_mla", 512, 64, n=1, H=128, k=16, rows=20, gain=True, dtype=dtype)


def test_non_contiguous_inputs(seed: int) -> None:
    from hisparse.kv.kernels.sparse_mla_triton import sparse_mla_rows
    g = torch.Generator().manual_seed(seed)
    layout = RowLayout.create("fp8_ds_mla", 32, 16)
    store = layout.pack(torch.randn(24, 48, generator=g))
    idx = torch.randint(-1, 24, (5, 20), generator=g)[:, ::2]                    # strided selection
    q = torch.randn(4, 5, 32, generator=g).transpose(0, 1)                      # [5, 4, 32], non-contiguous
    qr = torch.randn(5, 4, 32, generator=g)[..., ::2]                            # last dim strided
    ref_o, ref_lse = reference(q, qr, store, idx, layout, 0.1)
    o, lse = sparse_mla_rows(q.to(DEV), qr.to(DEV), store.to(DEV), idx.to(DEV), layout, 0.1)
    torch.testing.assert_close(o.cpu(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)


def test_every_fp8_byte_decodes_exactly(seed: int) -> None:
    """Rows whose fp8 bytes run through every e4m3 value (subnormals, both zeros, the largest), unit scales."""
    from hisparse.kv.kernels.sparse_mla_triton import sparse_mla_rows
    g = torch.Generator().manual_seed(seed)
    layout = RowLayout.create("fp8_ds_mla", 32, 16)
    store = layout.pack(torch.randn(8, 48, generator=g))
    values = torch.arange(256, dtype=torch.uint8).view(8, 32)
    store[:, :32] = torch.where((values & 0x7F) == 0x7F, 0, values)          # every byte but the two NaNs
    store[:, 32:40] = torch.ones(8, 2).view(torch.uint8)                      # tile scales 1.0
    idx = torch.arange(8).repeat(2, 1)
    q, qr = torch.zeros(2, 3, 32), torch.zeros(2, 3, 16)     # uniform weights: olat is each column's mean
    ref_o, ref_lse = reference(q, qr, store, idx, layout, 1.0)
    o, lse = sparse_mla_rows(q.to(DEV), qr.to(DEV), store.to(DEV), idx.to(DEV), layout, 1.0)
    # values reach 448: 1e-5 absolute is summation order; a subnormal decoded wrong is off by >= 2^-9 / 8
    torch.testing.assert_close(o.cpu(), ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-6, atol=1e-6)
