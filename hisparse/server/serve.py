"""`hisparse serve`: load a checkpoint, build the KV store and the engine, print the capacity, run uvicorn.

With -tp T > 1 or -dcp D > 1 this process is rank 0 of a parallel group (hisparse.parallel.serve starts the
followers); if the group breaks, every request in flight fails, /health answers 503, the server shuts down, the
followers are killed and `serve` exits non-zero naming the failed rank."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from types import FrameType

import uvicorn
from fastapi import FastAPI

from ..engine.cuda_graphs import DecodeGraphs, capture_graphs
from ..engine.full_graph import FullGraphs
from ..engine.engine import Engine
from ..engine.scheduler import SchedulerConfig
from ..engine.speculative import SpeculativeConfig
from ..kv.base import LatentKV
from ..model.dspark import DraftWindowCache
from ..model.ml4 import ML4
from ..model.tokenizer import load_tokenizer
from ..model.weights import load_model
from ..parallel.group import GroupError, RankGroup
from ..parallel.leader import Leader
from ..parallel.replica import own_store
from ..parallel.serve import FollowerRanks, GroupStartError, join_rank, load_rank, rank_lines, run_follower
from .app import build_app
from .connection import HeaderTimeoutH11
from .serve_config import ServeConfig

SWITCH_INTERVAL_S = 0.001   # GIL hand-over: the event loop waits at most this for the engine and worker threads
FINAL_EVENTS_S = 5.0   # after the drain: time for the failed requests' last events to reach their clients


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a bounded graceful shutdown. At the first SIGTERM/SIGINT uvicorn stops accepting
    connections; requests in flight get `drain_s` seconds to finish, then every one still running ends with a
    'server shutting down' error (an error event on a stream), its response completes and the server exits. A
    SIGTERM that shut the server down this way exits 0."""

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_s: float):
        super().__init__(config)
        self.engine, self.drain_s = engine, drain_s
        self.drain: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:   # handled here: not re-raised after the shutdown (that would exit 143)
            self._captured_signals.remove(sig)
        if self.drain is None:
            self.drain = threading.Timer(self.drain_s, self.engine.fail_all,
                                         (f"server shutting down (--shutdown-timeout {self.drain_s:g} s)",))
            self.drain.daemon = True
            self.drain.start()


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only accepts connections from the host it runs on."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:     # another host name: it may resolve to any interface
        return False


def capacity_lines(kv: LatentKV, offload: str, max_model_len: int) -> list[str]:
    """What fits, in the words of vLLM's startup log."""
    cap = kv.token_capacity()
    where = "device" if offload == "none" else "host pool"
    lines = [f"KV cache ({where}): unbounded; maximum model length {max_model_len:,} tokens"] if cap is None else [
        f"KV cache ({where}) size: {cap:,} tokens",
        f"Maximum concurrency for {max_model_len:,} tokens per request: {cap / max_model_len:.2f}x"]
    if offload != "none":
        store = own_store(kv)     # DCP: per rank
        rows = store.n_slots + store.window + store.sinks
        lines.append(f"Device latent rows per request and layer: {rows:,} (hot buffer {store.n_slots:,} + resident "
                     f"window {store.window:,} + sinks {store.sinks:,}), whatever the context length")
        if store.budget is not None:
            lines.append(f"Device KV budget: {store.budget:,} bytes = working sets of {store.working_set_bytes():,} "
                         f"bytes for at most {store.max_working_sets():,} running requests"
                         + (f", and resident pages of {store.page_tokens} tokens ({store.page_bytes:,} bytes) in "
                            "what they leave (hybrid)" if store.resident is not None else ""))
    return lines


def speculative_lines(spec: SpeculativeConfig, model: ML4) -> list[str]:
    window = DraftWindowCache.for_config(model.cfg)
    return [f"Speculative decoding: {spec.method}, {spec.num_speculative_tokens} draft tokens per step "
            f"(draft_sample_method {spec.draft_sample_method}); draft window cache {window.window:,} tokens, "
            f"{window.bytes_per_request:,} bytes per request"]


def build_engine(cfg: ServeConfig, model: ML4, kv: LatentKV, tokenizer, max_model_len: int,
                 group: RankGroup | None, graphs: DecodeGraphs | FullGraphs | None) -> Engine:
    """The engine (with rank 0's Leader hooks when `group`, the parallel group, is given)."""
    inner = tokenizer.instruct_tokenizer.tokenizer
    per_seq = SpeculativeConfig.rows_per_request(cfg.speculative)   # every decode step fits, drafts included
    limits = SchedulerConfig(max_model_len, cfg.max_num_seqs, max(cfg.max_num_batched_tokens,
                                                                  cfg.max_num_seqs * per_seq),
                             cfg.fair_prefill_tokens)
    lockstep = cfg.parallel is not None and cfg.parallel.tp_size > 1   # TP: every rank runs the drafter's forwards
    hooks = Leader(group, kv, lockstep_drafts=lockstep) if group is not None else None
    return Engine(model, kv, limits, eos_id=inner.eos_id, decode=inner.decode, speculative=cfg.speculative,
                  graphs=graphs, hooks=hooks)


def serve(cfg: ServeConfig) -> None:
    """Run the server until interrupted (with several ranks every rank builds its own KV store)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    par, followers = cfg.parallel, None
    if par is not None and "RANK" not in os.environ:      # under torchrun the ranks exist already
        followers = FollowerRanks(par, cfg.model_dir, cfg.device, cfg.dtype, cfg.kv, cfg.speculative,  # they load
                                  cfg.graph_rows)                                                        # meanwhile
    engine = None
    try:
        engine = _serve(cfg, followers)
    except GroupStartError as e:
        raise SystemExit(f"hisparse serve: {e}") from None
    except GroupError as e:    # the start-up exchange failed
        why = followers.diagnose() + ". " if followers is not None else ""
        raise SystemExit(f"hisparse serve: {why}{e}") from None
    finally:
        if followers is not None:   # after rank 0's stop message they leave on their own; otherwise: killed
            followers.close(grace_s=10.0 if engine is not None and engine.fatal is None else 0.0)
    if engine is not None and engine.fatal is not None:
        raise SystemExit(f"hisparse serve: stopped because the {par.name} group failed: {engine.fatal}")


def load(cfg: ServeConfig, followers: FollowerRanks | None) -> tuple[ML4, LatentKV, RankGroup | None]:
    """This rank's model and KV store, and the parallel group it joined (None: one rank)."""
    par, group = cfg.parallel, None
    if par is None:
        model = load_model(cfg.model_dir, device=cfg.device, dtype=cfg.dtype)
        return model, cfg.kv.attach(model), None
    if followers is None:     # torchrun: join first (this also picks the rank's GPU)
        group = RankGroup.from_env(cfg.device, par.timeout_s)
        if group.size != par.world_size:
            raise SystemExit(f"{par.name}: needs {par.world_size} processes, torchrun started {group.size}")
    model, kv, tp = load_rank(par, group.rank if group is not None else 0, cfg.model_dir, cfg.device, cfg.dtype,
                              cfg.kv)
    group = group or followers.join()
    return model, join_rank(group, par, tp, kv), group


def model_len(cfg: ServeConfig, model: ML4, kv: LatentKV) -> int:
    """--max-model-len, or the longest context the model and the KV cache allow (SystemExit if it cannot fit)."""
    cap, limit = kv.token_capacity(), model.cfg.max_position_embeddings
    max_model_len = cfg.max_model_len or (limit if cap is None else min(limit, cap))
    if max_model_len > limit:
        raise SystemExit(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    if not kv.can_ever_admit(max_model_len):
        raise SystemExit(f"--max-model-len {max_model_len} does not fit in the KV cache ({cap:,} tokens); "
                         "raise --host-pool-gib or lower --max-model-len")
    return max_model_len


def make_graphs(cfg: ServeConfig, model: ML4, kv: LatentKV) -> DecodeGraphs | FullGraphs | None:
    """Rank 0's decode graphs: full-step (recorded per step shape as steps first run), piecewise, or none."""
    if cfg.graph_mode == "full":
        return FullGraphs(model, kv, cfg.max_num_seqs, SpeculativeConfig.rows_per_request(cfg.speculative),
                          capture=True)
    return capture_graphs(model, cfg.graph_rows, cfg.graph_fallback) if cfg.graph_rows else None


def _serve(cfg: ServeConfig, followers: FollowerRanks | None) -> Engine | None:
    """Load, build and run until the HTTP server stops; the engine (None on a torchrun follower rank)."""
    model, kv, group = load(cfg, followers)
    if group is not None and group.rank > 0:
        run_follower(group, model, kv, cfg.speculative, cfg.graph_rows)
        group.close()
        return None
    tokenizer = load_tokenizer(cfg.model_dir)
    max_model_len = model_len(cfg, model, kv)
    graphs = make_graphs(cfg, model, kv)
    engine = build_engine(cfg, model, kv, tokenizer, max_model_len, group, graphs)
    server_cfg = replace(cfg.server, max_model_len=max_model_len)
    app = build_app(engine, tokenizer, server_cfg)
    lines = capacity_lines(kv, cfg.kv.offload, max_model_len)
    if group is not None:
        ranks = engine.hooks.start_up(model)
        lines += rank_lines(cfg.parallel, ranks, engine.rank_pools(), kv,
                            followers.pids() if followers is not None else {})
        engine.hooks.diagnose = followers.diagnose if followers is not None else None
    for line in lines + (speculative_lines(cfg.speculative, model) if cfg.speculative else []):
        print(line, flush=True)
    run_http(cfg, app, engine, f"Serving model '{server_cfg.model_name}' ({str(model.dtype).removeprefix('torch.')} "
                               f"on {model.device}) from {cfg.model_dir}")
    return engine


def run_http(cfg: ServeConfig, app: FastAPI, engine: Engine, what: str) -> None:
    """Serve `app` with uvicorn until a signal or a fatal engine error stops it."""
    if not cfg.server.api_key and not is_loopback(cfg.host):
        print(f"WARNING: listening on {cfg.host} without an API key: anyone who can reach this port can use the "
              "server (set --api-key or $HISPARSE_API_KEY)", file=sys.stderr, flush=True)
    print(f"{what} at http://{cfg.host}:{cfg.port}/v1 (Ctrl-C to stop)", flush=True)
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                           access_log=False,
                                           http=HeaderTimeoutH11.with_timeout(cfg.server.read_timeout_s),
                                           h11_max_incomplete_event_size=cfg.server.max_header_bytes,
                                           timeout_graceful_shutdown=cfg.shutdown_timeout_s + FINAL_EVENTS_S),
                            engine, cfg.shutdown_timeout_s)
    engine.on_fatal = lambda err: setattr(server, "should_exit", True)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server.run()
