"""Byte layouts of one cached latent row (spec §4) and the per-token geometry of a config.

fp8_ds_mla (FlashMLA sparse format): r x fp8_e4m3 c || (r / tile) x fp32 tile scales || dR x bf16 k_rope
  -> 512 + 16 + 128 = 656 B at full size.  bf16: (r + dR) x bf16 -> 1,152 B.  Indexer key: dI x fp8 + fp32
scale -> 132 B. `ResidentKV` and the host pool store the same bytes, so HiSparse on/off read identical rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import ModelConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FLT_MIN = torch.finfo(torch.float32).tiny
LAYOUTS = ("fp8_ds_mla", "bf16")


def fp8_tile(cfg: ModelConfig) -> int:
    """fp8 quantisation tile of the latent: 128 at full size (r = 512), 16 for the small test configs."""
    return 128 if cfg.kv_lora_rank >= 512 else 16


@dataclass(frozen=True)
class RowLayout:
    """How one latent row [r + dR] is stored as bytes."""
    name: str
    rank: int        # r, latent width
    rope_dim: int    # dR
    tile: int        # fp8 tile (fp8_ds_mla only)

    @classmethod
    def for_config(cls, cfg: ModelConfig, name: str) -> "RowLayout":
        if name not in LAYOUTS:
            raise ValueError(f"kv_layout: unknown layout {name!r}; choose one of {list(LAYOUTS)}")
        tile = fp8_tile(cfg)
        if cfg.kv_lora_rank % tile:
            raise ValueError(f"kv_layout: kv_lora_rank {cfg.kv_lora_rank} is not a multiple of the fp8 tile {tile}")
        return cls(name, cfg.kv_lora_rank, cfg.qk_rope_head_dim, tile)

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


def index_row_bytes(cfg: ModelConfig) -> int:
    """Indexer key row: dI x fp8 + one fp32 power-of-two scale (132 B at full size)."""
    return cfg.index_head_dim + 4


@dataclass(frozen=True)
class Geometry:
    """Per-token byte counts of a config under one layout (spec §4)."""
    row_bytes: int
    kv_owner_layers: int
    index_owner_layers: int
    n_layers: int
    index_row_bytes: int

    @classmethod
    def of(cls, cfg: ModelConfig, layout: str = "fp8_ds_mla") -> "Geometry":
        return cls(RowLayout.for_config(cfg, layout).row_bytes, len(cfg.kv_owner_layers),
                   len(cfg.index_owner_layers), cfg.n_layers, index_row_bytes(cfg))

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
