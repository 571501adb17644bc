"""Triton, when installed (the `gpu` extra): kernels run compiled on CUDA tensors, or under Triton's interpreter
on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (Triton decides per function when it
is decorated, its own library included)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:     # the torch paths need no Triton
    triton = tl = None

# fixed when this module is imported, just before the kernels are decorated
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether this process's Triton kernels were decorated for the interpreter (CPU tensors)."""
    return INTERPRETED


def require(t: torch.Tensor) -> None:
    """Raise a clear error unless a Triton kernel can run on tensors on t's device."""
    if triton is None:
        raise RuntimeError("kernels: the Triton kernels need `pip install triton` (the `gpu` extra)")
    if t.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"kernels: Triton kernels run on CUDA tensors (got {t.device}); on the CPU only under "
                           "TRITON_INTERPRET=1 set before triton is imported")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
