"""Triton, when installed (the `gpu` extra): kernels run compiled on CUDA tensors, or under Triton's interpreter
on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (Triton decides per function when it
is decorated, its own library included). Nothing here imports triton until a kernel is wanted."""

from __future__ import annotations

import importlib.util

import torch


def available() -> bool:
    """Whether the triton package is installed."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether this process's Triton kernels run under the interpreter (CPU tensors)."""
    if not available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from .miss_path_triton import _kernel
    return isinstance(_kernel, InterpretedFunction)


def require(t: torch.Tensor) -> None:
    """Raise a clear error unless a Triton kernel can run on tensors on t's device."""
    if not available():
        raise RuntimeError("kernels: the Triton kernels need the triton package (pip install 'hisparse[gpu]')")
    if t.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"kernels: Triton kernels run on CUDA tensors (got {t.device}); on the CPU only under "
                           "TRITON_INTERPRET=1 set before triton is imported")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
