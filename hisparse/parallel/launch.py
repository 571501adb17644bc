"""Start a DCP group as local processes and fail cleanly when a rank dies or hangs.

`launch(fn, size, *args)` spawns `size` ranks (spawn start method: safe with CUDA), joins them into one
process group (a file store in a private temp dir: no port to pick), runs fn(group, *args) on each, and
returns the rank-ordered return values. When a rank fails (exception, signal or exit), the survivors fail too —
their next collective sees the closed peer, or times out after `timeout_s` — and the launcher gives them that long
to report, then kills what is left. It raises DCPLaunchError naming every failed rank and why, and leaves no
process behind. torchrun users call `RankGroup.from_env` in their own entry point instead.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .group import DEFAULT_TIMEOUT_S, RankGroup

PR_SET_PDEATHSIG = 1


class DCPLaunchError(RuntimeError):
    """One or more DCP ranks failed; `errors` maps rank -> traceback or exit description (first failure first)."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        lines = [f"rank {r}: {e.strip().splitlines()[-1]}" for r, e in errors.items()]
        first = next((e for e in errors.values() if e.startswith("Traceback")), "")
        super().__init__("DCP run failed: " + "; ".join(lines) + ("\n\n" + first if first else ""))


def store_url(workdir: str | Path) -> str:
    """The rendezvous of a group whose ranks share `workdir` (a file store: no port to pick)."""
    return f"file://{Path(workdir) / 'store'}"


@contextmanager
def failure_report(workdir: str | Path, rank: int) -> Iterator[None]:
    """Run a rank's body; on any failure save its traceback as error{rank}.txt for the parent, then exit 1."""
    try:
        yield
    except BaseException:   # noqa: BLE001 - reported to the parent whatever it was
        (Path(workdir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1)


def _rank_main(rank: int, size: int, workdir: str, device: str, timeout_s: float, threads: int | None,
               fn: Callable[..., Any], args: tuple) -> None:
    """Body of one rank process: join the group, run fn, save its result (or its traceback, then exit 1)."""
    die_with_parent()
    with failure_report(workdir, rank):
        if threads:
            torch.set_num_threads(threads)
        group = RankGroup.init(rank, size, store_url(workdir), device, timeout_s)
        result = fn(group, *args)
        torch.save(result, Path(workdir) / f"result{rank}.pt")
        group.close()


def die_with_parent() -> None:
    """Linux: have the kernel kill this rank if the process (thread) that started it dies, so no rank outlives
    it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def rank_failure(workdir: str | Path, rank: int, code: int) -> str:
    """A failed rank's traceback, or how its process ended when it left none (killed, os._exit)."""
    err = Path(workdir) / f"error{rank}.txt"
    if err.exists():
        return err.read_text()
    return f"died: killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def launch(fn: Callable[..., Any], size: int, *args: Any, device: str = "cpu",
           timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None, grace_s: float | None = None,
           deadline_s: float | None = None) -> list[Any]:
    """Run fn(group: RankGroup, *args) on `size` spawned ranks; their return values, rank-ordered.

    fn and args must be picklable (fn a module-level function). device: where the ranks compute (it picks the
    backend: NCCL for cuda, gloo otherwise). threads: intra-op threads per rank. grace_s:
    how long the survivors of a failure get to fail on their own (default timeout_s + 1). deadline_s: a bound on
    the whole run (default: none)."""
    if size < 1:
        raise ValueError(f"dcp_size: must be >= 1, got {size}")
    grace_s = timeout_s + 1.0 if grace_s is None else grace_s
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hisparse-dcp-") as workdir:
        procs = [ctx.Process(target=_rank_main, args=(r, size, workdir, device, timeout_s, threads, fn, args),
                             name=f"dcp-rank{r}", daemon=True) for r in range(size)]
        failed: list[int] = []      # ranks in the order they failed
        killed: set[int] = set()
        start, stop = time.monotonic(), None
        try:
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs):
                multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=0.2)
                now = time.monotonic()
                failed += [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in failed]
                if failed and stop is None:
                    stop = now + grace_s
                if (stop is not None and now > stop) or (deadline_s is not None and now - start > deadline_s):
                    break
        finally:
            for r, p in enumerate(procs):
                if p.pid is None:       # never started (interrupted while starting)
                    continue
                if p.is_alive():
                    p.kill()
                    killed.add(r)
                p.join()
        failed += [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in failed + list(killed)]
        if failed or killed:
            why = "after the grace period" if failed else f"at the {deadline_s:g} s deadline"
            errors = {r: rank_failure(workdir, r, procs[r].exitcode) for r in failed}
            errors.update({r: f"still running {why}: killed by the launcher" for r in sorted(killed)})
            raise DCPLaunchError(errors)
        return [torch.load(Path(workdir) / f"result{r}.pt", weights_only=False) for r in range(size)]
