"""Byte layouts of one cached latent row (spec §4) and the per-token geometry of a config.

fp8_ds_mla (FlashMLA sparse format): r x fp8_e4m3 c || (r / tile) x fp32 tile scales || dR x bf16 k_rope
  -> 512 + 16 + 128 = 656 B at full size.  bf16: (r + dR) x bf16 -> 1,152 B.  Indexer key: dI x fp8 + fp32
scale -> 132 B. `ResidentKV` and the host pool store the same bytes, so HiSparse on/off read identical rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import gather_unpack as native

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FLT_MIN = torch.finfo(torch.float32).tiny
LAYOUTS = ("fp8_ds_mla", "bf16")
NATIVE = True   # read CPU rows with the fused kernel when it builds (False: always index_select + unpack)


def fp8_tile(rank: int) -> int:
    """fp8 quantisation tile of a latent of width `rank`: 128 at full size (r = 512), 16 for the small configs."""
    return 128 if rank >= 512 else 16


@dataclass(frozen=True)
class RowLayout:
    """How one latent row [r + dR] is stored as bytes."""
    name: str
    rank: int        # r, latent width
    rope_dim: int    # dR
    tile: int        # fp8 tile (fp8_ds_mla only)

    @classmethod
    def create(cls, name: str, rank: int, rope_dim: int) -> "RowLayout":
        """The layout `name` of a latent row of width `rank` + `rope_dim`."""
        if name not in LAYOUTS:
            raise ValueError(f"kv_layout: unknown layout {name!r}; choose one of {list(LAYOUTS)}")
        tile = fp8_tile(rank)
        if rank % tile:
            raise ValueError(f"kv_layout: kv_lora_rank {rank} is not a multiple of the fp8 tile {tile}")
        return cls(name, rank, rope_dim, tile)

    @property
    def row_bytes(self) -> int:
        if self.name == "fp8_ds_mla":
            return self.rank + 4 * (self.rank // self.tile) + 2 * self.rope_dim
        return 2 * (self.rank + self.rope_dim)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, r + dR] (any float dtype) -> bytes [T, row_bytes] uint8."""
        r, n = self.rank, rows.shape[0]
        rows = rows.float()
        if self.name == "bf16":
            return rows.to(torch.bfloat16).view(torch.uint8).reshape(n, self.row_bytes)
        c = rows[:, :r].reshape(n, r // self.tile, self.tile)
        scale = (c.abs().amax(-1) / FP8_MAX).clamp_min(FLT_MIN)                      # [T, r/tile] fp32
        c8 = (c / scale[..., None]).to(FP8).reshape(n, r)
        k_rope = rows[:, r:].to(torch.bfloat16)
        return torch.cat((c8.view(torch.uint8), scale.view(torch.uint8).reshape(n, 4 * (r // self.tile)),
                          k_rope.view(torch.uint8).reshape(n, 2 * self.rope_dim)), dim=1)

    def unpack(self, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """bytes [T, row_bytes] uint8 -> rows [T, r + dR] in `dtype` (exact dequantisation in fp32)."""
        r, n = self.rank, data.shape[0]
        if self.name == "bf16":
            return data.contiguous().view(torch.bfloat16).to(dtype)
        n_scales = r // self.tile
        c8 = data[:, :r].contiguous().view(FP8).float().view(n, n_scales, self.tile)
        scale = data[:, r:r + 4 * n_scales].contiguous().view(torch.float32)
        c = (c8 * scale[..., None]).view(n, r)
        k_rope = data[:, r + 4 * n_scales:].contiguous().view(torch.bfloat16).float()
        return torch.cat((c, k_rope), dim=1).to(dtype)

    def gather_unpack(self, store: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype = torch.float32
                      ) -> torch.Tensor:
        """unpack(store[idx]): rows of store [rows, row_bytes] uint8 at idx (any shape) -> [*idx.shape, r + dR] in
        `dtype`. CPU fp32/fp64 reads take the fused kernel (one pass, same bits) when it builds and NATIVE is set."""
        width = self.rank + self.rope_dim
        if NATIVE and native.supports(store, idx, dtype) and native.available():
            tile = self.tile if self.name == "fp8_ds_mla" else 0
            out = native.gather_unpack(store, idx, self.rank, self.rope_dim, tile, dtype)
        else:
            out = self.unpack(torch.index_select(store, 0, idx.flatten()), dtype)
        return out.view(*idx.shape, width)


def index_row_bytes(index_head_dim: int) -> int:
    """Indexer key row: dI x fp8 + one fp32 power-of-two scale (132 B at full size)."""
    return index_head_dim + 4


@dataclass(frozen=True)
class Geometry:
    """Per-token byte counts of a model under one layout (spec §4); `hisparse.kv.geometry` builds it from a config."""
    row_bytes: int
    kv_owner_layers: int
    index_owner_layers: int
    n_layers: int
    index_row_bytes: int

    @property
    def latent_bytes_per_token(self) -> int:
        """Host pool bytes per token: one row per KV-owning layer (consumers bind to their source)."""
        return self.row_bytes * self.kv_owner_layers

    @property
    def index_bytes_per_token(self) -> int:
        return self.index_row_bytes * self.index_owner_layers

    @property
    def total_bytes_per_token(self) -> int:
        return self.latent_bytes_per_token + self.index_bytes_per_token

    @property
    def sharing_gain(self) -> float:
        """Extra tokens per host byte from binding KV consumers to their source: n_layers / owners - 1."""
        return self.n_layers / self.kv_owner_layers - 1.0
