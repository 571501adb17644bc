"""Page-locked host memory at its exact size, for the host pool on CUDA machines.

`torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds a block up to a
power of two (a 100 GiB pool would pin 128 GiB). Here the pool is allocated pageable and then registered with
`cudaHostRegister` (through `torch.cuda.cudart()`) at exactly its size, portable (every device) and mapped into
the device address space, so the miss-path kernel reads it directly over UVA. Pinning commits every page, so a
pool over 95% of the host's available memory is refused with an error naming host_pool_gib (vLLM's rule).
"""

from __future__ import annotations

import weakref

import torch

RAM_SHARE = 0.95
HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2
GIB = 1 << 30


def available_ram() -> int:
    """Bytes of host memory available now (MemAvailable of /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def check_fits(nbytes: int, available: int | None = None) -> None:
    """ValueError naming host_pool_gib unless nbytes <= 95% of the available host memory."""
    available = available_ram() if available is None else available
    if nbytes > RAM_SHARE * available:
        raise ValueError(f"host_pool_gib: a pinned pool of {nbytes / GIB:.2f} GiB exceeds {RAM_SHARE:.0%} of the "
                         f"host's available memory ({available / GIB:.2f} GiB); choose a smaller --host-pool-gib")


def pinned_empty(shape: tuple[int, ...], owner: object) -> torch.Tensor:
    """An uninitialised uint8 host tensor of `shape`, page-locked at its exact size until `owner` is collected."""
    nbytes = 1
    for n in shape:
        nbytes *= n
    check_fits(nbytes)
    t = torch.empty(shape, dtype=torch.uint8)
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes,
                                                  HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED))
    if rc != 0:
        raise RuntimeError(f"host_pool_gib: cudaHostRegister of {nbytes} B failed (cudaError {rc})")
    weakref.finalize(owner, _unregister, t)     # holds t: unregistered, then freed
    return t


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
