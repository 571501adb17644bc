"""The fused row read (host_pool/kernels/gather_unpack.cpp) against its torch reference,
`RowLayout.unpack(torch.index_select(store, 0, idx))`: same bits for both layouts and output dtypes."""

from __future__ import annotations

import pytest
import torch

from hisparse.host_pool import layout as layout_mod
from hisparse.host_pool.kernels import gather_unpack as native
from hisparse.host_pool.layout import LAYOUTS, RowLayout
from hisparse.core.config import preset
from hisparse.kv.geometry import row_layout

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the row gather kernel")

DTYPES = [torch.float32, torch.float64]
FULL = {"fp8_ds_mla": RowLayout("fp8_ds_mla", 512, 64, 128), "bf16": RowLayout("bf16", 512, 64, 128)}


def layouts(names: tuple[str, ...] = LAYOUTS) -> list:
    """The layouts `names` at the tiny and small presets' geometries and at full size (r = 512, dR = 64)."""
    out = [pytest.param(row_layout(preset(p), name), id=f"{p}-{name}")
           for p in ("tiny", "small") for name in names]
    return out + [pytest.param(FULL[name], id=f"full-{name}") for name in names]


def reference(lay: RowLayout, store: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch path: index_select, then unpack."""
    return lay.unpack(torch.index_select(store, 0, idx.flatten()), dtype).view(*idx.shape, lay.rank + lay.rope_dim)


def fused(lay: RowLayout, store: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gather_unpack on the kernel path (the library is loaded, so it must be taken)."""
    assert layout_mod.NATIVE and native.supports(store, idx, dtype)
    return lay.gather_unpack(store, idx, dtype)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal shapes, dtypes, NaN positions, and bit patterns everywhere else (so -0.0 != 0.0)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    assert torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


def byte_store(lay: RowLayout, rows: int, seed: int) -> torch.Tensor:
    """Random byte rows (any fp8, scale and bf16 bit pattern: NaN, inf, subnormal), every fp8 byte value among the
    first rows' c bytes, followed by rows that pack() wrote from random floats (realistic scales)."""
    g = torch.Generator().manual_seed(seed)
    store = torch.randint(0, 256, (rows, lay.row_bytes), dtype=torch.uint8, generator=g)
    if lay.name == "fp8_ds_mla":
        c = store[:, :lay.rank].reshape(-1)
        c[:256] = torch.arange(256, dtype=torch.uint8)[: c.numel()]
        store[:, :lay.rank] = c.view(rows, lay.rank)
    packed = lay.pack(torch.randn(rows, lay.rank + lay.rope_dim, generator=g) * 10.0 ** torch.randint(
        -6, 4, (rows, 1), generator=g))
    return torch.cat((store, packed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lay", layouts())
def test_kernel_matches_torch(lay: RowLayout, dtype: torch.dtype) -> None:
    store = byte_store(lay, 64, 0)
    g = torch.Generator().manual_seed(1)
    every = torch.arange(store.shape[0])
    repeats = torch.randint(0, store.shape[0], (300,), generator=g)            # with repeats
    grid = torch.randint(0, store.shape[0], (9, 13), generator=g)              # [n, k]
    for idx in (every, repeats, grid, every.flip(0)[:, None]):
        assert_same_bits(fused(lay, store, idx, dtype), reference(lay, store, idx, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lay", layouts(("fp8_ds_mla",)))
def test_every_fp8_byte_times_scales(lay: RowLayout, dtype: torch.dtype) -> None:
    """Each fp8 byte (incl. NaN 0x7f / 0xff and the subnormals) times scales from 1 down to fp32 subnormals."""
    n_scales = lay.rank // lay.tile
    scales = torch.tensor([1.0, 2.0 ** -10, 1e-30, 2.0 ** -126, 1e-40, 448.0, -3.5])
    c = torch.arange(256, dtype=torch.uint8).repeat(-(-lay.rank // 256) * len(scales))
    rows = c[: len(scales) * lay.rank].view(len(scales), lay.rank)
    scale_bytes = scales[:, None].expand(-1, n_scales).contiguous().view(torch.uint8)
    rope = torch.randn(len(scales), lay.rope_dim).to(torch.bfloat16).view(torch.uint8)
    store = torch.cat((rows, scale_bytes, rope), dim=1)
    idx = torch.arange(len(scales))
    assert_same_bits(fused(lay, store, idx, dtype), reference(lay, store, idx, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lay", layouts())
def test_empty_idx(lay: RowLayout, dtype: torch.dtype) -> None:
    store = byte_store(lay, 4, 2)
    for shape in ((0,), (3, 0), (0, 5)):
        idx = torch.zeros(shape, dtype=torch.long)
        out = fused(lay, store, idx, dtype)
        assert out.shape == (*shape, lay.rank + lay.rope_dim) and out.dtype == dtype
        assert_same_bits(out, reference(lay, store, idx, dtype))
    empty = torch.zeros(0, lay.row_bytes, dtype=torch.uint8)
    assert fused(lay, empty, torch.zeros(2, 0, dtype=torch.long), dtype).shape == (2, 0, lay.rank + lay.rope_dim)


@pytest.mark.parametrize("lay", layouts())
def test_out_of_range_idx(lay: RowLayout) -> None:
    store = byte_store(lay, 8, 3)
    for bad in (store.shape[0], -1):
        idx = torch.tensor([[0, 1], [bad, 2]])
        with pytest.raises(IndexError, match="idx"):
            fused(lay, store, idx, torch.float32)


def test_torch_path_when_not_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """NATIVE off, a non-contiguous store or another dtype take the torch path (same rows)."""
    lay = row_layout(preset("small"), "fp8_ds_mla")
    store = byte_store(lay, 16, 4)
    idx = torch.randint(0, store.shape[0], (5, 3), generator=torch.Generator().manual_seed(5))
    want = reference(lay, store, idx, torch.float32)
    wide = torch.cat((store, store), dim=1)[:, : lay.row_bytes]
    assert not native.supports(wide, idx, torch.float32)
    assert_same_bits(lay.gather_unpack(wide, idx), want)
    assert_same_bits(lay.gather_unpack(store, idx, torch.bfloat16), reference(lay, store, idx, torch.bfloat16))
    monkeypatch.setattr(layout_mod, "NATIVE", False)
    assert_same_bits(lay.gather_unpack(store, idx), want)


def test_threads_give_the_same_rows() -> None:
    """A read big enough to be split over threads equals the one-thread read."""
    lay = FULL["fp8_ds_mla"]
    store = byte_store(lay, 256, 6)
    idx = torch.randint(0, store.shape[0], (16, 128), generator=torch.Generator().manual_seed(7))
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused(lay, store, idx, torch.float32)
        torch.set_num_threads(4)
        assert_same_bits(fused(lay, store, idx, torch.float32), one)
    finally:
        torch.set_num_threads(prev)
    assert_same_bits(one, reference(lay, store, idx, torch.float32))
