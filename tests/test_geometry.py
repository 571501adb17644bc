"""KV row layouts and per-token byte arithmetic (ML4_SPEC §4, §9.9)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from hisparse.host_pool.layout import index_row_bytes
from hisparse.core.config import preset
from hisparse.kv.geometry import geometry, row_layout

FLT_MIN = np.finfo(np.float32).tiny


def test_full_size_row_bytes() -> None:
    cfg = preset("full")
    assert row_layout(cfg, "fp8_ds_mla").row_bytes == 656      # 512 fp8 + 4 x fp32 + 64 bf16
    assert row_layout(cfg, "bf16").row_bytes == 1152
    assert index_row_bytes(cfg.index_head_dim) == 132


def test_full_size_per_token_bytes() -> None:
    cfg = preset("full")
    g = geometry(cfg, "fp8_ds_mla")
    assert (g.kv_owner_layers, g.index_owner_layers, g.n_layers) == (63, 44, 72)
    assert g.latent_bytes_per_token == 41_328
    assert g.index_bytes_per_token == 5_808
    assert g.total_bytes_per_token == 47_136
    assert geometry(cfg, "bf16").total_bytes_per_token == 78_384
    assert g.sharing_gain == pytest.approx(72 / 63 - 1) and round(g.sharing_gain, 4) == 0.1429
    # HiSparse host-pool bound of §4: 440 GiB / 41,328 B = 11.43 M tokens
    assert 440 * 2**30 // g.latent_bytes_per_token == pytest.approx(11.43e6, rel=1e-3)


def test_tiny_geometry() -> None:
    cfg = preset("tiny")
    fp8 = row_layout(cfg, "fp8_ds_mla")
    assert (fp8.tile, fp8.row_bytes) == (16, 32 + 2 * 4 + 8 * 2)         # r/16 = 2 scales per row
    assert geometry(cfg).latent_bytes_per_token == 7 * 56
    with pytest.raises(ValueError, match="kv_layout"):
        row_layout(cfg, "fp16")


def parse_fp8_row(row: np.ndarray, r: int, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read one fp8_ds_mla row with numpy: (c8 bytes [r], fp32 scales [r/tile], k_rope bf16 bits [dR])."""
    n = r // tile
    return row[:r], row[r:r + 4 * n].view(np.float32), row[r + 4 * n:].view(np.uint16)


@pytest.mark.parametrize("name", ["tiny", "full"])
def test_fp8_pack_layout_and_scales(name: str, seed: int) -> None:
    """Bytes [0, r): fp8 c / s; [r, r + 4 r/tile): fp32 tile scales max(amax/448, FLT_MIN); then k_rope bf16."""
    cfg = preset(name)
    lay = row_layout(cfg, "fp8_ds_mla")
    r, dR, tile = cfg.kv_lora_rank, cfg.qk_rope_head_dim, lay.tile
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(5, r + dR, generator=g) * torch.rand(5, 1, generator=g) * 10
    rows[1, :tile] = 0                                                    # an all-zero tile
    rows[2, :r] = 1e-42                                                   # denormal amax: scale clamps to FLT_MIN
    data = lay.pack(rows)
    assert data.dtype == torch.uint8 and data.shape == (5, lay.row_bytes)
    for i in range(5):
        c8, scales, rope_bits = parse_fp8_row(data[i].numpy(), r, tile)
        amax = rows[i, :r].view(-1, tile).abs().amax(-1).numpy()
        np.testing.assert_array_equal(scales, np.maximum(amax / np.float32(448), FLT_MIN).astype(np.float32))
        assert rope_bits.tobytes() == rows[i, r:].bfloat16().view(torch.int16).numpy().tobytes()
        c8f = torch.from_numpy(c8.copy()).view(torch.float8_e4m3fn).float().numpy()
        assert np.abs(c8f).max() <= 448
    assert parse_fp8_row(data[1].numpy(), r, tile)[1][0] == FLT_MIN


@pytest.mark.parametrize("name", ["tiny", "full"])
def test_fp8_round_trip_within_fp8_error(name: str, seed: int) -> None:
    cfg = preset(name)
    lay = row_layout(cfg, "fp8_ds_mla")
    r, tile = cfg.kv_lora_rank, lay.tile
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(64, r + cfg.qk_rope_head_dim, generator=g) * 3
    back = lay.unpack(lay.pack(rows))
    c, c_back = rows[:, :r].view(64, -1, tile), back[:, :r].view(64, -1, tile)
    scale = c.abs().amax(-1, keepdim=True) / 448
    # round to nearest e4m3: half an ulp = 2^-4 relative for normals, 2^-10 x scale for subnormals
    assert ((c - c_back).abs() <= torch.maximum(c.abs() * 2**-4, scale * 2**-10) * 1.0001).all()
    assert torch.equal(back[:, r:], rows[:, r:].bfloat16().float())
    # the tile maximum maps to 448 and comes back up to the rounding of the fp32 scale
    torch.testing.assert_close(c_back.abs().amax(-1), c.abs().amax(-1), rtol=2e-7, atol=0)
    for dtype in (torch.float64, torch.bfloat16):
        assert lay.unpack(lay.pack(rows), dtype).dtype == dtype


def test_fp8_round_trip_exact_for_representable_values(seed: int) -> None:
    """c = (fp8 value) x 2^e with a +-448 in every tile, k_rope bf16: pack/unpack returns it bit for bit."""
    cfg = preset("full")
    lay = row_layout(cfg, "fp8_ds_mla")
    r, dR, tile = 512, 64, 128
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    c8 = grid[torch.randint(0, len(grid), (8, r), generator=g)].view(8, -1, tile)
    c8[:, :, 0] = 448.0 * torch.sign(torch.randn(8, r // tile, generator=g))
    e = 2.0 ** torch.randint(-20, 5, (8, r // tile, 1), generator=g).float()
    rows = torch.cat(((c8 * e).view(8, r), torch.randn(8, dR, generator=g).bfloat16().float()), dim=1)
    assert torch.equal(lay.unpack(lay.pack(rows)), rows)


def test_bf16_layout_round_trip(seed: int) -> None:
    cfg = preset("tiny")
    lay = row_layout(cfg, "bf16")
    rows = torch.randn(7, 40, generator=torch.Generator().manual_seed(seed))
    data = lay.pack(rows)
    assert data.shape == (7, 80)
    exact = rows.bfloat16()
    assert torch.equal(lay.unpack(data, torch.bfloat16), exact)
    assert data[3].numpy().tobytes() == exact[3].view(torch.int16).numpy().tobytes()


def test_host_pool_does_not_import_the_model() -> None:
    """The host pool is bytes and pages: it takes its geometry as numbers, so importing it loads no model code."""
    code = "import sys, hisparse.host_pool.pool, hisparse.host_pool.layout; " \
           "print(sorted(m for m in sys.modules if m.startswith('hisparse.model')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
