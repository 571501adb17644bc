"""The process group of a parallel run (tensor and/or decode context parallelism): collectives with a timeout, so
a dead or hung peer raises instead of blocking forever.

The backend follows the device the ranks compute on (`--device`): NCCL for cuda, gloo otherwise, whatever the
machine has; every tensor handed to a collective must live on that device (checked, so a CPU tensor cannot reach
NCCL). Ranks are started by `hisparse.parallel.launch` (spawned processes) or by torchrun
(`RankGroup.from_env`). Every rank runs the same batch, so every rank issues the same collectives in the same order.
With gloo a collective whose peer died fails at once (connection closed) and one whose peer hangs fails after
`timeout_s`; with NCCL the watchdog tears the process down after `timeout_s`, which the launcher reports.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from ..engine.hooks import EngineFatal

DEFAULT_TIMEOUT_S = 60.0
# torch 2.11 (the GPU image's) has only all_gather_into_tensor; later torch names it all_gather_single and
# deprecates the old name. Same collective, same result.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class GroupError(EngineFatal):
    """A collective failed: a peer rank died, hung past the timeout, or the group is broken."""


def backend_for(device: torch.device | str) -> str:
    """The collective backend for ranks computing on `device`: NCCL for cuda, gloo for anything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class RankGroup:
    """This process's rank in a group of `size` ranks (wraps a torch.distributed process group); `device` is where
    the tensors of its collectives live."""

    def __init__(self, pg: dist.ProcessGroup | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: torch.device | str = "cpu"):
        self.pg, self.timeout_s, self.device = pg, timeout_s, torch.device(device)
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)

    @classmethod
    def init(cls, rank: int, size: int, init_method: str = "env://", device: torch.device | str = "cpu",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "RankGroup":
        """Join the default process group as `rank` of `size` (init_method: file://, tcp:// or env://) with the
        backend `device` calls for; a cuda rank uses GPU LOCAL_RANK (or its rank) modulo the visible GPUs."""
        backend = backend_for(device)
        if backend == "nccl":
            index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(None, timeout_s, device)

    @classmethod
    def from_env(cls, device: torch.device | str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> "RankGroup":
        """Join as torchrun describes this process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"parallel ranks from torchrun: environment variable(s) {missing} not set")
        return cls.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", device, timeout_s)

    def subgroup(self, block: int) -> "RankGroup":
        """This rank's group of `block` consecutive ranks of this group (members g*block .. (g+1)*block - 1); only
        that block's ranks call it (a group-local rendezvous)."""
        if self.size % block:
            raise ValueError(f"a group of {self.size} ranks does not split into blocks of {block}")
        if block == self.size:
            return self
        ranks = dist.get_process_group_ranks(self.pg or dist.group.WORLD)
        g = self.rank // block
        pg = dist.new_group(ranks[g * block:(g + 1) * block], timeout=datetime.timedelta(seconds=self.timeout_s),
                            use_local_synchronization=True)
        return RankGroup(pg, self.timeout_s, self.device)

    def _check(self, x: torch.Tensor, op: str, what: str) -> torch.Tensor:
        if x.device != self.device:
            raise ValueError(f"rank {self.rank}: {op} for {what}: tensor on {x.device}, the group's collectives "
                             f"run on {self.device}")
        return x.contiguous()

    def all_reduce(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """The sum of x over every rank (every rank gets the same bits); GroupError (naming `what`) if it fails."""
        if self.size == 1:
            return x
        x = self._check(x, "all_reduce", what)
        try:
            dist.all_reduce(x, group=self.pg)
        except Exception as e:   # noqa: BLE001 - as all_gather
            raise self._failed("all_reduce", what, e) from e
        return x

    def all_gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [n, ...] from every rank -> [size, n, ...] in rank order; GroupError (naming `what`) if it fails."""
        if self.size == 1:
            return x[None]
        x = self._check(x, "all_gather", what)
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        try:
            _all_gather_single(out, x, group=self.pg)
        except Exception as e:   # noqa: BLE001 - every backend failure (timeout, closed peer) means the same here
            raise self._failed("all_gather", what, e) from e
        return out.view(self.size, *x.shape)

    def all_to_all(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [size, ...]: x[j] goes to rank j; returns [size, ...] whose j-th entry came from rank j; GroupError
        (naming `what`) if it fails."""
        if self.size == 1:
            return x
        x = self._check(x, "all_to_all", what)
        out = torch.empty_like(x)
        try:
            dist.all_to_all_single(out, x, group=self.pg)
        except Exception as e:   # noqa: BLE001 - as all_gather
            raise self._failed("all_to_all", what, e) from e
        return out

    def broadcast_object(self, obj: Any, what: str) -> Any:
        """Rank 0's picklable `obj` on every rank (the others pass None); GroupError (naming `what`) if it fails."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, group=self.pg, group_src=0)
        except Exception as e:   # noqa: BLE001 - as all_gather
            raise self._failed("broadcast", what, e) from e
        return box[0]

    def _failed(self, op: str, what: str, e: Exception) -> GroupError:
        return GroupError(f"rank {self.rank}/{self.size}: {op} for {what} failed (a peer rank died, hung past the "
                        f"{self.timeout_s:g} s timeout, or left the group): {e}")

    def close(self) -> None:
        """Leave the default group (call on success only; after a failure just exit)."""
        if self.pg is None and dist.is_initialized():
            dist.destroy_process_group()
