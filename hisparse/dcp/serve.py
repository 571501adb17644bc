"""`hisparse serve --dcp-size R`: the serve process is rank 0 (scheduler, HTTP server, sampling) and starts R-1
follower rank processes that replay its steps on their own shards.

Each follower loads the same checkpoint and builds its own KV store from the same KVSettings (its own host pool
of --host-pool-gib), marks itself ready, and joins the group (gloo on CPU, NCCL on CUDA; a file store in a private
temp dir). Rank 0 waits for every follower to be ready (a follower that fails to start ends `serve` with its
error), joins, and all ranks exchange their pool sizes (printed at startup). Followers die with rank 0 (Linux
parent-death signal), ignore Ctrl-C (rank 0 decides when they leave), and leave on rank 0's stop message.
Under torchrun (`torchrun --nproc-per-node R -m hisparse.cli serve ... --dcp-size R`) every process loads, joins
from the environment, and ranks > 0 run `run_follower` instead of the server.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.kv_settings import KVSettings
from ..engine.runner import ModelRunner
from ..engine.spec_decode import Speculator
from ..engine.speculative import SpeculativeConfig
from ..model.dspark import DSparkDrafter
from ..model.kv import LatentKV
from ..model.ml4 import ML4
from ..model.weights import load_model
from .context import DCPContext
from .follower import Follower
from .group import DEFAULT_TIMEOUT_S, DCPGroup
from .kv import ShardedKV
from .launch import die_with_parent, failure_report, rank_failure, store_url
from .replica import RankPool, gather_pools

@dataclass(frozen=True)
class DCPServeConfig:
    """--dcp-size, --dcp-interleave, --dcp-timeout."""
    size: int
    interleave: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str | None = None     # None: nccl on CUDA, gloo otherwise

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"dcp_size: must be >= 1, got {self.size}")
        if self.interleave < 1:
            raise ValueError(f"dcp_interleave: must be >= 1, got {self.interleave}")
        if not self.timeout_s > 0:
            raise ValueError(f"dcp_timeout: must be > 0 seconds, got {self.timeout_s}")


def run_follower(group: DCPGroup, model: ML4, kv: LatentKV, interleave: int,
                 speculative: SpeculativeConfig | None) -> Follower:
    """A follower rank's life after joining: the start-up pool exchange, then rank 0's steps until it says stop
    (returns the follower as it ended)."""
    sharded = ShardedKV(kv, DCPContext(group, interleave))
    gather_pools(group, sharded)
    speculator = None
    if speculative is not None:
        speculator = Speculator(speculative, DSparkDrafter(model), sharded, model.cfg.mtp.sliding_window)
    runner = ModelRunner(model, sharded, speculator.tap_layers if speculator else ())
    follower = Follower(group, runner, speculator)
    follower.run()
    return follower


def follower_main(rank: int, cfg: DCPServeConfig, workdir: str, model_dir: Path, device: str, dtype: torch.dtype,
                  kv_settings: KVSettings, speculative: SpeculativeConfig | None) -> None:
    """Body of a spawned follower process (a traceback goes to error{rank}.txt for rank 0)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with failure_report(workdir, rank):
        if device.startswith("cuda"):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        model = load_model(model_dir, device=device, dtype=dtype)
        kv = kv_settings.build(model.cfg, device, dtype)
        (Path(workdir) / f"ready{rank}").touch()
        group = DCPGroup.init(rank, cfg.size, store_url(workdir), cfg.backend, cfg.timeout_s)
        run_follower(group, model, kv, cfg.interleave, speculative)
        group.close()


class DCPStartError(RuntimeError):
    """A follower rank failed before the group was up."""


class FollowerRanks:
    """Rank 0's handle on the follower processes it spawned: readiness, joining, diagnosis, clean-up."""

    def __init__(self, cfg: DCPServeConfig, model_dir: Path, device: str, dtype: torch.dtype,
                 kv_settings: KVSettings, speculative: SpeculativeConfig | None):
        self.cfg = cfg
        self._tmp = tempfile.TemporaryDirectory(prefix="hisparse-dcp-")
        self.workdir = Path(self._tmp.name)
        ctx = multiprocessing.get_context("spawn")
        self.procs = {r: ctx.Process(target=follower_main, name=f"dcp-rank{r}", daemon=True,
                                     args=(r, cfg, str(self.workdir), model_dir, device, dtype, kv_settings,
                                           speculative))
                      for r in range(1, cfg.size)}
        for p in self.procs.values():
            p.start()

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def join(self) -> DCPGroup:
        """Wait until every follower has loaded (DCPStartError naming a follower that failed), then join as rank 0."""
        while missing := [r for r in self.procs if not (self.workdir / f"ready{r}").exists()]:
            dead = [r for r in missing if self.procs[r].exitcode is not None]
            if dead:
                raise DCPStartError("DCP follower rank(s) failed to start: " + self.describe(dead))
            multiprocessing.connection.wait([self.procs[r].sentinel for r in missing], timeout=0.2)
        try:
            return DCPGroup.init(0, self.cfg.size, store_url(self.workdir), self.cfg.backend, self.cfg.timeout_s)
        except Exception as e:   # noqa: BLE001 - a follower that died or hung between loading and joining
            raise DCPStartError(f"DCP group did not form ({e}): {self.describe()}") from e

    def describe(self, ranks: list[int] | None = None) -> str:
        """How each follower is doing: its exit (the last line of its traceback) or that it is still running."""
        out = []
        for r in self.procs if ranks is None else ranks:
            p = self.procs[r]
            if p.exitcode is None:
                out.append(f"rank {r} (pid {p.pid}) is still running but did not answer within the "
                           f"{self.cfg.timeout_s:g} s timeout (hung)")
            else:
                why = rank_failure(self.workdir, r, p.exitcode).strip().splitlines()[-1]
                out.append(f"rank {r} (pid {p.pid}) {why if why.startswith(('died', 'exited')) else 'failed: ' + why}")
        return "; ".join(out)

    def diagnose(self, settle_s: float = 1.0) -> str:
        """After a failed collective: which follower died or hung (waits up to settle_s for a dying one to go)."""
        deadline = time.monotonic() + settle_s
        while all(p.exitcode is None for p in self.procs.values()) and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in self.procs.values()], timeout=0.05)
        exited = [r for r, p in self.procs.items() if p.exitcode is not None]
        return "DCP " + self.describe(exited or None)

    def close(self, grace_s: float = 10.0) -> None:
        """Give the followers grace_s to leave (after rank 0's stop message), kill what is left, clean up."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()


def pool_lines(pools: list[RankPool], kv: ShardedKV, pids: dict[int, int]) -> list[str]:
    """Startup lines: the sharding, each rank's host pool and the total."""
    sh = kv.sharding
    lines = [f"DCP: {sh.size} ranks, interleave {sh.interleave}: token p lives on rank floor(p / {sh.interleave}) "
             f"mod {sh.size}; collective timeout {kv.dcp.group.timeout_s:g} s"]
    pids = {0: os.getpid(), **pids}
    for r, p in enumerate(pools):
        pid = f" (pid {pids[r]})" if r in pids else ""
        lines.append(f"DCP rank {r}{pid}: host pool {p.capacity_tokens:,} tokens")
    total = sum(p.capacity_tokens for p in pools)
    cap = kv.token_capacity()
    longest = "unbounded" if cap is None else f"{cap:,} tokens (rank 0 holds the largest share of any context)"
    lines.append(f"DCP total: host pools {total:,} tokens on {sh.size} ranks; longest context {longest}")
    return lines
