"""Build and load a native CPU kernel: one C++ source compiled with the system compiler into a plain shared
library, loaded with ctypes (see indexer_topk.py for why not a torch extension).

Libraries are cached per user in $HISPARSE_CACHE/kernels (default ~/.cache/hisparse), under a name that hashes
the source, flags, compiler and CPU, so a changed source, compiler or machine gets a fresh build.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path


def cpu_id() -> str:
    """What -march=native (and torch's and MKL's kernel dispatch) depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "".join(l for l in info.splitlines(keepends=True) if l.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor() + platform.machine()


def _build(cxx: str, source: Path, out: Path, flags: Sequence[str], optional: Sequence[str]) -> None:
    """Compile `source` to `out`, with the `optional` flags if they build, else without them (atomically:
    concurrent first uses each write a temp file and rename it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        for extra in ((list(optional), []) if optional else ([],)):
            proc = subprocess.run([cxx, *flags, *extra, str(source), "-o", tmp], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp, out)
                return
        raise RuntimeError(f"{cxx} failed to build {source.name}:\n{proc.stderr[-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, flags: Sequence[str], optional: Sequence[str] = (), name: str = "kernel",
         fallback: str = "using the torch path") -> ctypes.CDLL | None:
    """The library built from `source` with `flags` (plus `optional` where they build), compiled on first use;
    None, with one warning naming `name` and the `fallback` callers take, when it cannot be built or loaded.
    Callers cache the result (each call checks the compiler)."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        warnings.warn(f"no C++ compiler (set CXX): {fallback}")
        return None
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *flags, *optional, version, cpu_id()]).encode()).hexdigest()
    root = Path(os.environ.get("HISPARSE_CACHE", Path.home() / ".cache" / "hisparse")) / "kernels"
    path = root / f"{source.stem}-{key[:16]}.so"
    try:
        if not path.exists():
            _build(cxx, source, path, flags, optional)
        return ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        warnings.warn(f"{name} unavailable ({e}); {fallback}")
        return None
