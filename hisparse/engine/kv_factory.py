"""Build the LatentKV an engine runs on from user settings (`--kv-offload hisparse|none`)."""

from __future__ import annotations

import torch

from ..model.config import ModelConfig
from ..model.kv import LatentKV, ResidentKV


def build_kv(cfg: ModelConfig, offload: str = "hisparse", layout: str = "fp8_ds_mla", device: str = "cpu",
             host_pool_gib: float = 4.0, hot_buffer_tokens: int | None = None,
             resident_window: int | None = None, dtype: torch.dtype = torch.float32) -> LatentKV:
    if offload == "none":
        return ResidentKV(cfg, layout, device, dtype)
    if offload != "hisparse":
        raise ValueError(f"kv_offload: unknown value {offload!r}; choose 'hisparse' or 'none'")
    from ..gpu_working_set.hisparse_kv import HiSparseKV
    return HiSparseKV(cfg, layout=layout, device=device, dtype=dtype, host_pool_gib=host_pool_gib,
                      hot_buffer_tokens=hot_buffer_tokens, resident_window=resident_window)
