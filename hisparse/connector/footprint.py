"""The device memory hisparse's store takes under vLLM at its limits (--max-num-seqs requests of --max-model-len
tokens, --max-num-batched-tokens new rows per step), from the store's own byte accounting.

vLLM's GPU worker profiles its memory (`determine_available_memory`: the model's dummy run) before it creates the
worker's connector, whose store is allocated only then. So the model's dummy run holds the store's bytes on the
device (`hold_for_profile`) and the worker frees them just before its store allocates the same bytes at these
limits (`WorkerState`, `LatentKV.reserve_device`): vLLM's profile counts them as memory in use and sizes its own
(one dummy-layer) cache from what is left, so `--gpu-memory-utilization` bounds both. Within the limits the store
never grows while serving.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kv.settings import KVSettings
from ..core.config import ModelConfig
from .settings import HiSparseConfigError


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
    per_request = kv.request_device_bytes(max_model_len)
    kv.reserve_device(max_num_seqs, max_model_len, max_num_batched_tokens)
    return DeviceFootprint(per_request, kv.device_nbytes(), max_num_seqs)


_held: list[torch.Tensor] = []   # this process's stand-in for its store while vLLM profiles the memory


def hold_for_profile(nbytes: int, device: torch.device) -> None:
    """Allocate `nbytes` on `device` (once) and keep them until `release_profile_hold`."""
    if not _held:
        _held.append(torch.empty(nbytes, dtype=torch.uint8, device=device))


def release_profile_hold() -> int:
    """Free the stand-in (before the store takes its place); returns the bytes it held."""
    nbytes = sum(t.numel() for t in _held)
    if _held:
        device = _held[0].device
        _held.clear()
        if device.type not in ("cpu", "meta"):
            torch.accelerator.empty_cache()   # back to the device, for the store's own tensors
    return nbytes


def check_device_budget(utilization: float, device: torch.device) -> None:
    """Refuse to serve when this process's live device tensors (weights + the store, now allocated) exceed
    `--gpu-memory-utilization` of the device. vLLM sizes the dummy layer's cache from `num_gpu_blocks_override`,
    not from the memory its profile left, so it would not refuse by itself. The live tensors are a lower bound of
    what the instance takes (no CUDA context, activations or vLLM's cache): this never refuses what fits."""
    used = torch.cuda.memory_allocated(device)
    budget = utilization * torch.cuda.get_device_properties(device).total_memory
    if used > budget:
        raise HiSparseConfigError(
            f"--gpu-memory-utilization {utilization}: the model's weights and hisparse's store take {used:,} device "
            f"bytes, more than the {budget:,.0f} allowed; raise --gpu-memory-utilization or lower --max-num-seqs / "
            "--max-model-len")
