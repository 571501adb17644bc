"""`hisparse serve`: load a checkpoint, build the KV store and the engine, print the capacity, run uvicorn.

With -tp T > 1 or -dcp D > 1 this process is rank 0 of a parallel group (hisparse.parallel.serve starts the
followers); if the group breaks, every request in flight fails, /health answers 503, the server shuts down, the
followers are killed and `serve` exits non-zero naming the failed rank."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import torch
import uvicorn

from ..parallel.group import DCPError, DCPGroup
from ..parallel.replica import own_store
from ..parallel.leader import DCPEngine
from ..parallel.serve import (DCPStartError, FollowerRanks, ParallelConfig, join_rank, load_rank, rank_lines,
                              run_follower)
from ..engine.cuda_graphs import DecodeGraphs, GraphSettingError, capture_graphs, graphs_wanted
from ..engine.engine import Engine
from ..parallel.tp import check_splits
from ..kv.settings import KVSettings
from ..engine.scheduler import SchedulerConfig
from ..engine.speculative import SpeculativeConfig
from ..core.config import ModelConfig
from ..model.dspark import DraftWindowCache
from ..kv.base import LatentKV
from ..model.ml4 import ML4
from ..model.tokenizer import load_tokenizer
from ..model.weights import load_model
from .app import ServerConfig, build_app
from .connection import HeaderTimeoutH11


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
    where = "host pool" if offload == "hisparse" else "device"
    lines = [f"KV cache ({where}): unbounded; maximum model length {max_model_len:,} tokens"] if cap is None else [
        f"KV cache ({where}) size: {cap:,} tokens",
        f"Maximum concurrency for {max_model_len:,} tokens per request: {cap / max_model_len:.2f}x"]
    if offload == "hisparse":
        store = own_store(kv)     # DCP: per rank
        rows = store.n_slots + store.window + store.sinks
        lines.append(f"Device latent rows per request and layer: {rows:,} (hot buffer {store.n_slots:,} + resident "
                     f"window {store.window:,} + sinks {store.sinks:,}), whatever the context length")
    return lines


def speculative_config(spec: str | None, model_dir: Path) -> SpeculativeConfig | None:
    """--speculative-config, checked against the checkpoint's params.json before any weight is loaded."""
    if spec is None:
        return None
    cfg = ModelConfig.load(model_dir)
    try:
        return SpeculativeConfig.parse(spec, cfg)
    except ValueError as e:
        raise SystemExit(f"--speculative-config: {e}") from None


def speculative_lines(spec: SpeculativeConfig, model: ML4) -> list[str]:
    window = DraftWindowCache.for_config(model.cfg)
    return [f"Speculative decoding: {spec.method}, {spec.num_speculative_tokens} draft tokens per step "
            f"(draft_sample_method {spec.draft_sample_method}); draft window cache {window.window:,} tokens, "
            f"{window.bytes_per_request:,} bytes per request"]


def build_engine(model: ML4, kv: LatentKV, tokenizer, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, speculative: SpeculativeConfig | None = None,
                 group: DCPGroup | None = None, tp_size: int = 1, graphs: DecodeGraphs | None = None,
                 fair_prefill_tokens: int = 0) -> Engine:
    """The engine (rank 0's DCPEngine when `group`, the parallel group, is given)."""
    inner = tokenizer.instruct_tokenizer.tokenizer
    per_seq = SpeculativeConfig.rows_per_request(speculative)   # every decode step fits, drafts included
    cfg = SchedulerConfig(max_model_len, max_num_seqs, max(max_num_batched_tokens, max_num_seqs * per_seq),
                          fair_prefill_tokens)
    kwargs = dict(eos_id=inner.eos_id, decode=inner.decode, speculative=speculative, graphs=graphs)
    if group is None:
        return Engine(model, kv, cfg, **kwargs)
    return DCPEngine(model, kv, group, cfg, lockstep_drafts=tp_size > 1, **kwargs)


def parallel_config(args: argparse.Namespace) -> ParallelConfig | None:
    """-tp / -dcp / --dcp-interleave / --dcp-timeout (None: one rank)."""
    try:
        cfg = ParallelConfig(args.tensor_parallel_size, args.decode_context_parallel_size, args.dcp_interleave,
                             args.dcp_timeout)
    except ValueError as e:
        flag = {"tp_size": "tensor-parallel-size", "dcp_size": "decode-context-parallel-size"}.get(
            str(e).split(":")[0], str(e).split(":")[0].replace("_", "-"))
        raise SystemExit(f"--{flag}: {e}") from None
    return cfg if cfg.world_size > 1 else None


def serve(args: argparse.Namespace, model_dir: Path, dtype: torch.dtype, kv_settings: KVSettings) -> None:
    """Run the server until interrupted. The model computes in `dtype` on --device; `kv_settings` (the CLI's KV
    flags) builds the LatentKV (with several ranks every rank builds its own)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    speculative = speculative_config(args.speculative_config, model_dir)
    par = parallel_config(args)
    try:     # every rank makes decode graphs for a step of every running request (drafts included), or none does
        per_seq = SpeculativeConfig.rows_per_request(speculative)
        graph_rows = args.max_num_seqs * per_seq if graphs_wanted(args.cuda_graph, args.device,
                                                                  kv_settings.kernel_path(args.device)) else 0
    except GraphSettingError as e:
        raise SystemExit(str(e)) from None
    if par is not None and par.tp_size > 1:   # before any rank process starts
        try:
            check_splits(ModelConfig.load(model_dir), par.tp_size)
        except ValueError as e:
            raise SystemExit(f"--tensor-parallel-size: {e}") from None
    followers = None
    if par is not None and "RANK" not in os.environ:      # under torchrun the ranks exist already
        followers = FollowerRanks(par, model_dir, args.device, dtype, kv_settings, speculative,   # they load
                                  graph_rows)                                                    # meanwhile
    engine = None
    try:
        engine = _serve(args, model_dir, dtype, kv_settings, speculative, par, followers, graph_rows)
    except DCPStartError as e:
        raise SystemExit(f"hisparse serve: {e}") from None
    except DCPError as e:    # the start-up exchange failed
        why = followers.diagnose() + ". " if followers is not None else ""
        raise SystemExit(f"hisparse serve: {why}{e}") from None
    finally:
        if followers is not None:   # after rank 0's stop message they leave on their own; otherwise: killed
            followers.close(grace_s=10.0 if engine is not None and engine.fatal is None else 0.0)
    if engine is not None and engine.fatal is not None:
        raise SystemExit(f"hisparse serve: stopped because the {par.name} group failed: {engine.fatal}")


def _serve(args: argparse.Namespace, model_dir: Path, dtype: torch.dtype, kv_settings: KVSettings,
           speculative: SpeculativeConfig | None, par: ParallelConfig | None,
           followers: FollowerRanks | None, graph_rows: int) -> Engine | None:
    """Load, build and run until the HTTP server stops; the engine (None on a torchrun follower rank)."""
    group = None
    if par is not None and followers is None:     # torchrun: join first (this also picks the rank's GPU)
        group = DCPGroup.from_env(args.device, par.timeout_s)
        if group.size != par.world_size:
            raise SystemExit(f"{par.name}: needs {par.world_size} processes, torchrun started {group.size}")
    rank = group.rank if group is not None else 0
    if par is not None:
        model, kv, tp = load_rank(par, rank, model_dir, args.device, dtype, kv_settings)
        group = group or followers.join()
        kv = join_rank(group, par, tp, kv)
        if group.rank > 0:
            run_follower(group, model, kv, speculative, graph_rows)
            group.close()
            return None
    else:
        model = load_model(model_dir, device=args.device, dtype=dtype)
        kv = kv_settings.build(model.cfg, args.device, dtype)
        model.use_kernels(kv_settings.kernel_path(args.device))
    tokenizer = load_tokenizer(model_dir)
    cap = kv.token_capacity()
    limit = model.cfg.max_position_embeddings if cap is None else min(model.cfg.max_position_embeddings, cap)
    max_model_len = args.max_model_len or limit
    if max_model_len > model.cfg.max_position_embeddings:
        raise SystemExit(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{model.cfg.max_position_embeddings}")
    if not kv.can_ever_admit(max_model_len):
        raise SystemExit(f"--max-model-len {max_model_len} does not fit in the KV cache ({cap:,} tokens); "
                         "raise --host-pool-gib or lower --max-model-len")
    graphs = None     # made where run_follower makes its own
    if graph_rows:
        graphs = capture_graphs(model, graph_rows, fallback=args.cuda_graph == "auto" and par is None)
    engine = build_engine(model, kv, tokenizer, max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                          speculative, group, par.tp_size if par is not None else 1, graphs, args.fair_prefill_tokens)
    name = args.served_model_name or model_dir.name
    app = build_app(engine, tokenizer, ServerConfig(
        name, max_model_len, args.api_key, args.debug_hooks, args.max_request_bytes, args.read_timeout,
        args.max_batch_fanout, args.max_logit_bias, args.max_logprobs, args.max_header_bytes, args.enable_docs))
    lines = capacity_lines(kv, kv_settings.offload, max_model_len)
    if par is not None:
        ranks = engine.start_up(model)
        lines += rank_lines(par, ranks, engine.rank_pools(), kv, followers.pids() if followers is not None else {})
        engine.diagnose = followers.diagnose if followers is not None else None
    for line in lines + (speculative_lines(speculative, model) if speculative else []):
        print(line, flush=True)
    if not args.api_key and not is_loopback(args.host):
        print(f"WARNING: listening on {args.host} without an API key: anyone who can reach this port can use the "
              "server (set --api-key or $HISPARSE_API_KEY)", file=sys.stderr, flush=True)
    print(f"Serving model '{name}' ({str(model.dtype).removeprefix('torch.')} on {model.device}) from {model_dir} "
          f"at http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, http=HeaderTimeoutH11.with_timeout(args.read_timeout),
                                           h11_max_incomplete_event_size=args.max_header_bytes,
                                           timeout_graceful_shutdown=args.shutdown_timeout + FINAL_EVENTS_S),
                            engine, args.shutdown_timeout)
    engine.on_fatal = lambda err: setattr(server, "should_exit", True)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server.run()
    return engine
