"""The host pool's pinned memory: the 95%-of-available-RAM rule (any machine) and exact-size registration
(CUDA only)."""

from __future__ import annotations

import pytest
import torch

from hisparse.host_pool.layout import RowLayout
from hisparse.host_pool.pinned import GIB, available_ram, check_fits
from hisparse.host_pool.pool import HostPool


def test_pool_over_95_percent_of_available_ram_is_refused() -> None:
    check_fits(95 * GIB, available=100 * GIB)
    with pytest.raises(ValueError, match="host_pool_gib.*exceeds 95%"):
        check_fits(95 * GIB + 1, available=100 * GIB)
    assert 0 < available_ram()


def test_pinned_pool_beyond_the_host_fails_before_allocating() -> None:
    layout = RowLayout.create("fp8_ds_mla", 512, 64)
    with pytest.raises(ValueError, match="host_pool_gib"):
        HostPool(layout, [0, 1], host_pool_gib=available_ram() / GIB * 2, page_tokens=64, pin=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pins host memory through CUDA (cudaHostRegister)")
def test_pinned_pool_is_registered_at_its_exact_size() -> None:
    """A pool of 1.5 GiB pins 1.5 GiB (the caching host allocator would round it to 2 GiB) and is page-locked,
    mapped memory a CUDA kernel can read."""
    layout = RowLayout.create("fp8_ds_mla", 512, 64)
    pool = HostPool(layout, [0], host_pool_gib=1.5, page_tokens=64, pin=True)
    assert pool.buffer.is_pinned() and pool.nbytes <= 1.5 * GIB
    rows = torch.arange(0, pool.token_capacity, 4099)
    pool.rows[rows] = torch.randint(0, 256, (rows.numel(), layout.row_bytes), dtype=torch.uint8)
    assert torch.equal(pool.rows.cuda()[rows.cuda()].cpu(), pool.rows[rows])
