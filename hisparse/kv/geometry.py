"""A model config's host-pool geometry: the row layout of its latent and its per-token byte counts (spec §4).

The host pool knows bytes and layers, not models; this is the one place that reads those numbers off a config.
"""

from __future__ import annotations

from ..host_pool.layout import Geometry, RowLayout, index_row_bytes
from ..core.config import ModelConfig


def row_layout(cfg: ModelConfig, name: str) -> RowLayout:
    """How one latent row [kv_lora_rank + qk_rope_head_dim] of `cfg` is stored under layout `name`."""
    return RowLayout.create(name, cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def geometry(cfg: ModelConfig, layout: str = "fp8_ds_mla") -> Geometry:
    """Per-token host and indexer bytes of `cfg` under `layout`."""
    return Geometry(row_layout(cfg, layout).row_bytes, len(cfg.kv_owner_layers), len(cfg.index_owner_layers),
                    cfg.n_layers, index_row_bytes(cfg.index_head_dim))
