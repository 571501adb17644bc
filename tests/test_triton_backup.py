"""The Triton backup kernel: new rows land in their host-pool rows byte for byte (index_copy_ is the
reference), other pool rows untouched. Without CUDA it runs under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hisparse.core import triton_support

pytestmark = pytest.mark.skipif(
    not (triton_support.available() and (torch.cuda.is_available() or triton_support.interpreted())),
    reason="needs triton, and CUDA or the Triton interpreter (TRITON_INTERPRET=1 before triton is imported)")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n, row_bytes", [(0, 16), (1, 656), (37, 16), (16, 1152)])
def test_rows_land_in_their_pool_rows(n: int, row_bytes: int, seed: int) -> None:
    from hisparse.gpu_working_set.kernels.backup_triton import backup
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (100, row_bytes), dtype=torch.uint8, generator=g)
    if DEV.type == "cuda":
        pool = pool.pin_memory()
    rows = torch.randperm(100, generator=g)[:n]
    data = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=g)
    ref = pool.clone().index_copy_(0, rows, data)
    backup(data.to(DEV), pool, rows.to(DEV))
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(pool, ref)
