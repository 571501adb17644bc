"""`hisparse serve -tp T -dcp D`: the serve process is rank 0 (scheduler, HTTP server, sampling) and starts the
follower rank processes that replay its steps: T ranks with tensor parallelism (each its share of the weights;
D | T ranks per DCP group, consecutive ranks), or D ranks of DCP alone (each the whole model).

Each follower loads its share of the checkpoint and builds its own KV store from the same KVSettings (its own host
pool of --host-pool-gib), marks itself ready, and joins the group (gloo on CPU, NCCL on CUDA: the backend follows
--device; a file store in a private temp dir). Rank 0 waits for every follower to be ready (a follower that fails
to start ends `serve` with its error), joins, and all ranks exchange their weight bytes and pool sizes (printed at
startup). Followers die with rank 0 (Linux parent-death signal), ignore Ctrl-C (rank 0 decides when they leave),
and leave on rank 0's stop message. Under torchrun (`torchrun --nproc-per-node N -m hisparse.cli serve ...`)
every process joins from the environment, loads, and ranks > 0 run `run_follower` instead of the server.
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

from ..engine.cuda_graphs import capture_graphs
from ..kv.settings import KVSettings
from ..engine.runner import ModelRunner
from ..engine.spec_decode import Speculator
from ..engine.speculative import SpeculativeConfig
from ..model.dspark import DSparkDrafter
from ..kv.base import LatentKV
from ..model.ml4 import ML4
from ..model.weights import load_model
from .tp import TensorParallel
from .context import DCPContext
from .follower import Follower
from .group import DEFAULT_TIMEOUT_S, RankGroup
from .sharded_kv import ShardedKV
from .launch import die_with_parent, failure_report, rank_failure, store_url
from .replica import RankInfo, RankPool, gather_pools, gather_ranks

@dataclass(frozen=True)
class ParallelConfig:
    """--tensor-parallel-size, --decode-context-parallel-size, --dcp-interleave, --dcp-timeout."""
    tp_size: int = 1
    dcp_size: int = 1
    interleave: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        for name in ("tp_size", "dcp_size", "interleave"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.tp_size > 1 and self.tp_size % self.dcp_size:
            raise ValueError(f"dcp_size: {self.dcp_size} must divide tensor_parallel_size {self.tp_size} (each DCP "
                             "group is a block of consecutive TP ranks)")
        if not self.timeout_s > 0:
            raise ValueError(f"dcp_timeout: must be > 0 seconds, got {self.timeout_s}")

    @property
    def name(self) -> str:
        """How logs and errors call the group: "TP4 DCP2", "TP2", "DCP4"."""
        return " ".join(f"{k}{n}" for k, n in (("TP", self.tp_size), ("DCP", self.dcp_size)) if n > 1)

    @property
    def world_size(self) -> int:
        """Rank processes: one per TP rank (DCP groups inside), or one per DCP rank without TP."""
        return self.tp_size if self.tp_size > 1 else self.dcp_size


def load_rank(cfg: ParallelConfig, rank: int, model_dir: Path, device: str, dtype: torch.dtype,
              kv_settings: KVSettings) -> tuple[ML4, LatentKV, TensorParallel | None]:
    """This rank's share of the model and its own KV store (before joining: sharding needs only the rank)."""
    tp = TensorParallel(rank, cfg.tp_size) if cfg.tp_size > 1 else None
    model = load_model(model_dir, device=device, dtype=dtype, shard=tp.shard if tp is not None else None)
    return model, kv_settings.attach(model), tp


def join_rank(group: RankGroup, cfg: ParallelConfig, tp: TensorParallel | None, kv: LatentKV) -> LatentKV:
    """After joining `group` (every rank): the TP hooks get the group, and with DCP the store becomes this rank's
    shard of its DCP group (consecutive ranks)."""
    if tp is not None:
        tp.bind(group)
    if cfg.dcp_size == 1:
        return kv
    return ShardedKV(kv, DCPContext(group.subgroup(cfg.dcp_size), cfg.interleave, heads_split=cfg.tp_size > 1))


def run_follower(group: RankGroup, model: ML4, kv: LatentKV, speculative: SpeculativeConfig | None,
                 graph_rows: int = 0) -> Follower:
    """A follower rank's life after joining (kv: from `join_rank`): its decode graphs of up to `graph_rows` rows
    (0: none; made where rank 0 makes its own, before the start-up exchanges: a capture's warm-up runs the
    pieces' collectives on every rank), the start-up exchanges, then rank 0's steps until it says stop (returns
    the follower as it ended)."""
    graphs = capture_graphs(model, graph_rows, fallback=False) if graph_rows else None
    gather_ranks(group, model, kv)
    gather_pools(group, kv)
    speculator = None
    if speculative is not None:
        speculator = Speculator(speculative, DSparkDrafter(model), kv, model.cfg.mtp.sliding_window)
    runner = ModelRunner(model, kv, speculator.tap_layers if speculator else (), graphs)
    follower = Follower(group, runner, speculator)
    follower.run()
    return follower


def follower_main(rank: int, cfg: ParallelConfig, workdir: str, model_dir: Path, device: str, dtype: torch.dtype,
                  kv_settings: KVSettings, speculative: SpeculativeConfig | None, graph_rows: int) -> None:
    """Body of a spawned follower process (a traceback goes to error{rank}.txt for rank 0)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with failure_report(workdir, rank):
        if device.startswith("cuda"):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        model, kv, tp = load_rank(cfg, rank, model_dir, device, dtype, kv_settings)
        (Path(workdir) / f"ready{rank}").touch()
        group = RankGroup.init(rank, cfg.world_size, store_url(workdir), device, cfg.timeout_s)
        run_follower(group, model, join_rank(group, cfg, tp, kv), speculative, graph_rows)
        group.close()


class GroupStartError(RuntimeError):
    """A follower rank failed before the group was up."""


class FollowerRanks:
    """Rank 0's handle on the follower processes it spawned: readiness, joining, diagnosis, clean-up."""

    def __init__(self, cfg: ParallelConfig, model_dir: Path, device: str, dtype: torch.dtype,
                 kv_settings: KVSettings, speculative: SpeculativeConfig | None, graph_rows: int = 0):
        self.cfg, self.device = cfg, device
        self._tmp = tempfile.TemporaryDirectory(prefix="hisparse-dcp-")
        self.workdir = Path(self._tmp.name)
        ctx = multiprocessing.get_context("spawn")
        self.procs = {r: ctx.Process(target=follower_main, name=f"dcp-rank{r}", daemon=True,
                                     args=(r, cfg, str(self.workdir), model_dir, device, dtype, kv_settings,
                                           speculative, graph_rows))
                      for r in range(1, cfg.world_size)}
        for p in self.procs.values():
            p.start()

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def join(self) -> RankGroup:
        """Wait until every follower has loaded (GroupStartError naming a follower that failed), then join as rank 0."""
        while missing := [r for r in self.procs if not (self.workdir / f"ready{r}").exists()]:
            dead = [r for r in missing if self.procs[r].exitcode is not None]
            if dead:
                raise GroupStartError("DCP follower rank(s) failed to start: " + self.describe(dead))
            multiprocessing.connection.wait([self.procs[r].sentinel for r in missing], timeout=0.2)
        try:
            return RankGroup.init(0, self.cfg.world_size, store_url(self.workdir), self.device, self.cfg.timeout_s)
        except Exception as e:   # noqa: BLE001 - a follower that died or hung between loading and joining
            raise GroupStartError(f"DCP group did not form ({e}): {self.describe()}") from e

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
        return f"{self.cfg.name} " + self.describe(exited or None)

    def close(self, grace_s: float = 10.0) -> None:
        """Give the followers grace_s to leave (after rank 0's stop message), kill what is left, clean up."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()


def rank_lines(cfg: ParallelConfig, ranks: list[RankInfo], pools: list[RankPool], kv: LatentKV,
               pids: dict[int, int]) -> list[str]:
    """Startup lines: the split, each rank's weights, working set and host pool, and the totals."""
    lines = [f"{cfg.name}: {cfg.world_size} rank processes; collective timeout {cfg.timeout_s:g} s"]
    if cfg.tp_size > 1:
        lines.append(f"TP: {cfg.tp_size} ranks, each 1/{cfg.tp_size} of the heads, FFNs, vocabulary and routed "
                     "experts (indexer, latent head and drafter replicated)")
    if isinstance(kv, ShardedKV):
        sh = kv.sharding
        lines.append(f"DCP: {sh.size} ranks, interleave {sh.interleave}: token p lives on rank floor(p / "
                     f"{sh.interleave}) mod {sh.size}" + (f" of its group of {sh.size} consecutive ranks"
                                                          if cfg.world_size > sh.size else ""))
    pids = {0: os.getpid(), **pids}
    for r, (info, p) in enumerate(zip(ranks, pools)):
        pid = f" (pid {pids[r]})" if r in pids else ""
        lines.append(f"{'DCP' if cfg.tp_size == 1 else 'TP'} rank {r}{pid}: host pool {p.capacity_tokens:,} tokens, "
                     f"weights {info.weight_bytes:,} bytes, working set {info.working_set_bytes:,} bytes per request")
    cap = kv.token_capacity()
    longest = "unbounded" if cap is None else f"{cap:,} tokens" + (" (rank 0 holds the largest share of any "
                                                                   "context)" if isinstance(kv, ShardedKV) else "")
    lines.append(f"{cfg.name} total: weights {sum(i.weight_bytes for i in ranks):,} bytes, host pools "
                 f"{sum(p.capacity_tokens for p in pools):,} tokens on {cfg.world_size} ranks; longest context "
                 f"{longest}")
    return lines
