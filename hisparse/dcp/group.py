"""The DCP process group: collectives with a timeout, so a dead or hung peer raises instead of blocking forever.

Gloo on CPU, NCCL on CUDA. Ranks are started by `hisparse.dcp.launch` (spawned processes) or by torchrun
(`DCPGroup.from_env`). Every rank runs the same batch, so every rank issues the same collectives in the same order.
With gloo a collective whose peer died fails at once (connection closed) and one whose peer hangs fails after
`timeout_s`; with NCCL the watchdog tears the process down after `timeout_s`, which the launcher reports.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class DCPError(RuntimeError):
    """A DCP collective failed: a peer rank died, hung past the timeout, or the group is broken."""


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class DCPGroup:
    """This process's rank in a DCP group of `size` ranks (wraps a torch.distributed process group)."""

    def __init__(self, pg: dist.ProcessGroup | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.pg, self.timeout_s = pg, timeout_s
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)

    @classmethod
    def init(cls, rank: int, size: int, init_method: str = "env://", backend: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "DCPGroup":
        """Join the default process group as `rank` of `size` (init_method: file://, tcp:// or env://)."""
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(None, timeout_s)

    @classmethod
    def from_env(cls, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "DCPGroup":
        """Join as torchrun describes this process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"DCP from torchrun: environment variable(s) {missing} not set")
        return cls.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", backend, timeout_s)

    def all_gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [n, ...] from every rank -> [size, n, ...] in rank order; DCPError (naming `what`) if it fails."""
        if self.size == 1:
            return x[None]
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        try:
            dist.all_gather_single(out, x, group=self.pg)
        except Exception as e:   # noqa: BLE001 - every backend failure (timeout, closed peer) means the same here
            raise self._failed("all_gather", what, e) from e
        return out.view(self.size, *x.shape)

    def broadcast_object(self, obj: Any, what: str) -> Any:
        """Rank 0's picklable `obj` on every rank (the others pass None); DCPError (naming `what`) if it fails."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, group=self.pg, group_src=0)
        except Exception as e:   # noqa: BLE001 - as all_gather
            raise self._failed("broadcast", what, e) from e
        return box[0]

    def _failed(self, op: str, what: str, e: Exception) -> DCPError:
        return DCPError(f"DCP rank {self.rank}/{self.size}: {op} for {what} failed (a peer rank died, hung past the "
                        f"{self.timeout_s:g} s timeout, or left the group): {e}")

    def close(self) -> None:
        """Leave the default group (call on success only; after a failure just exit)."""
        if self.pg is None and dist.is_initialized():
            dist.destroy_process_group()
