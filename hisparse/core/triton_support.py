"""Triton, when installed (the `gpu` extra): kernels run compiled on CUDA tensors, or under Triton's interpreter
on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (Triton decides per function when it
is decorated, its own library included). Nothing here imports triton until a kernel is wanted.

Every kernel launch goes through `launch`, so the specialisations the engine launches can be recorded
(`recording`) instead of run: the ahead-of-time compilation (`hisparse.triton_kernels`) enumerates them by
calling the launch functions on meta tensors, and the tests compare what the engine launches with that list."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def available() -> bool:
    """Whether the triton package is installed."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether this process's Triton kernels run under the interpreter (CPU tensors)."""
    if not available():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    # Triton's own library is decorated as the kernels are (the variable is read when a function is decorated)
    return isinstance(tl.standard.sum, InterpretedFunction)


def require(t: torch.Tensor) -> None:
    """Raise a clear error unless a Triton kernel can run on tensors on t's device."""
    if _recorder.specs is not None and not _recorder.run:
        return                                  # recording only: nothing runs, meta tensors are fine
    if not available():
        raise RuntimeError("kernels: the Triton kernels need the triton package (pip install 'hisparse[gpu]')")
    if t.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"kernels: Triton kernels run on CUDA tensors (got {t.device}); on the CPU only under "
                           "TRITON_INTERPRET=1 set before triton is imported")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


@dataclass(frozen=True)
class Specialization:
    """One compiled form of a kernel: its argument types (pointers by element type, integers by width, as
    Triton's launcher types them), its constexpr values and its compile options."""
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...] = ()

    def source(self, fn: object) -> object:
        """The `triton.compiler.ASTSource` of this specialisation of the JITFunction fn."""
        import triton
        const = dict(self.constexprs)
        return triton.compiler.ASTSource(fn=fn, signature=dict(self.signature) | dict.fromkeys(const, "constexpr"),
                                         constexprs=const)


def _arg_type(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"launch: no Triton type for a kernel argument of type {type(v).__name__}")


def specialization(kernel: object, args: tuple, kwargs: dict) -> Specialization:
    """The specialisation that launching kernel(*args, **kwargs) compiles (kwargs: constexprs and options)."""
    fn = getattr(kernel, "fn", kernel)
    params = list(inspect.signature(fn).parameters)
    const = {k: v for k, v in kwargs.items() if k in params}
    return Specialization(f"{fn.__module__}.{fn.__name__}",
                          tuple((name, _arg_type(v)) for name, v in zip(params, args)),
                          tuple(sorted(const.items())),
                          tuple(sorted((k, v) for k, v in kwargs.items() if k not in params)))


class _Recorder:
    specs: list[Specialization] | None = None
    run = True


_recorder = _Recorder()


@contextlib.contextmanager
def recording(run: bool = False) -> Iterator[list[Specialization]]:
    """Record the specialisation of every kernel launch inside the block. With run=False the kernels do not run
    and inputs may be meta tensors (the launch code runs up to each launch); with run=True they also run."""
    saved = _recorder.specs, _recorder.run
    _recorder.specs, _recorder.run = [], run
    try:
        yield _recorder.specs
    finally:
        _recorder.specs, _recorder.run = saved


def launch(kernel: object, grid: tuple, *args: object, **kwargs: object) -> None:
    """kernel[grid](*args, **kwargs); inside `recording()` its specialisation is recorded first."""
    if _recorder.specs is not None:
        _recorder.specs.append(specialization(kernel, args, kwargs))
        if not _recorder.run:
            return
    kernel[grid](*args, **kwargs)
