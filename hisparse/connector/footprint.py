"""The device memory hisparse's store takes under vLLM at its limits (--max-num-seqs requests of --max-model-len
tokens, --max-num-batched-tokens new rows per step), from the store's own byte accounting.

Each worker allocates its store at these limits when it starts (`WorkerState`, `LatentKV.reserve_device`), before
vLLM's memory profile, so vLLM counts it as memory in use and sizes its own (one dummy-layer) cache from what is
left: `--gpu-memory-utilization` bounds both. Within the limits the store never grows while serving.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..engine.kv_settings import KVSettings
from ..model.config import ModelConfig


@dataclass(frozen=True)
class DeviceFootprint:
    """Device bytes per request (working set + indexer keys of max_model_len tokens, or every latent row when
    all-resident) and in all (the stores as allocated for max_num_seqs requests, step rows included)."""
    per_request: int
    total: int
    max_num_seqs: int


def device_footprint(cfg: ModelConfig, settings: KVSettings, dtype: torch.dtype, max_num_seqs: int,
                     max_model_len: int, max_num_batched_tokens: int) -> DeviceFootprint:
    """The footprint of the store `settings` builds, measured on a meta-device copy of it (nothing allocated)."""
    kv = replace(settings, host_pool_gib=0.01).build(cfg, "meta", dtype)   # the pool's size changes nothing here
    pages = -(-max_model_len // kv.page_tokens)
    per_request = pages * kv.index_keys.bytes_per_page()
    if hasattr(kv, "arena"):
        per_request += kv.arena.slot_bytes() + sum(h.nbytes_per_slot() for h in kv.hot.values())
    else:
        per_request += pages * kv.rows.bytes_per_page()
    kv.reserve_device(max_num_seqs, max_model_len, max_num_batched_tokens)
    return DeviceFootprint(per_request, kv.device_nbytes(), max_num_seqs)
