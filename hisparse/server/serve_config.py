"""ServeConfig: everything `hisparse serve` runs with, built and checked once from its flags and passed down.

`from_args` reads the argparse namespace (the only place that does) and ends the command with a message naming
the flag for any bad value, before a process starts or a weight loads: the parallel split, the speculative
config against the checkpoint's params.json, the CUDA graph mode against the device and kernels. The KV kernel
path is resolved here (--kernels auto -> triton or torch), so every rank, the graphs and the store agree on it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..core.config import ModelConfig
from ..engine.cuda_graphs import GraphSettingError, graphs_wanted
from ..engine.speculative import SpeculativeConfig
from ..kv.settings import KVSettings, KVSettingsError
from ..parallel.serve import ParallelConfig
from ..parallel.tp import check_splits
from .config import ServerConfig

PARALLEL_FLAGS = {"tp_size": "tensor-parallel-size", "dcp_size": "decode-context-parallel-size"}


@dataclass(frozen=True)
class ServeConfig:
    model_dir: Path
    device: str
    dtype: torch.dtype                       # the model's compute dtype
    kv: KVSettings                           # kernels resolved: 'triton' or 'torch'
    parallel: ParallelConfig | None          # None: one rank
    speculative: SpeculativeConfig | None    # None: no speculative decoding
    cuda_graph: str                          # --cuda-graph
    graph_mode: str | None                   # the graphs made: 'full', 'piecewise' (parallel ranks) or None
    graph_rows: int                          # rows of the decode graphs every rank captures (0: none)
    max_model_len: int | None                # None: the model's limit or the KV capacity, whichever is less
    max_num_seqs: int
    max_num_batched_tokens: int
    fair_prefill_tokens: int
    server: ServerConfig                     # the HTTP API's settings (max_model_len set once known)
    host: str
    port: int
    log_level: str
    shutdown_timeout_s: float

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_dir: Path, dtype: torch.dtype,
                  kv: KVSettings) -> ServeConfig:
        """The configuration of `hisparse serve`'s flags (SystemExit naming the flag for a bad value)."""
        try:
            kv = replace(kv, kernels=kv.kernel_path(args.device))
        except KVSettingsError as e:
            raise SystemExit(f"--{e.field}: {e.problem}") from None
        speculative = speculative_config(args.speculative_config, model_dir)
        parallel = parallel_config(args, model_dir)
        try:     # every rank makes decode graphs for a step of every running request (drafts included), or none
            mode = graphs_wanted(args.cuda_graph, args.device, kv.kernels)
        except GraphSettingError as e:
            raise SystemExit(str(e)) from None
        if mode == "full" and parallel is not None:    # ranks capture the pieces around their collectives
            mode = "piecewise"
        graph_rows = args.max_num_seqs * SpeculativeConfig.rows_per_request(speculative) if mode else 0
        server = ServerConfig(args.served_model_name or model_dir.name, 0, args.api_key, args.debug_hooks,
                              args.max_request_bytes, args.read_timeout, args.max_batch_fanout, args.max_logit_bias,
                              args.max_logprobs, args.max_header_bytes, args.enable_docs)
        return cls(model_dir, args.device, dtype, kv, parallel, speculative, args.cuda_graph, mode, graph_rows,
                   args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens, args.fair_prefill_tokens,
                   server, args.host, args.port, args.log_level, args.shutdown_timeout)

    @property
    def graph_fallback(self) -> bool:
        """Whether a failed capture may fall back to eager decode (one rank: parallel ranks never fall back alone,
        the others would wait in a captured collective)."""
        return self.parallel is None


def speculative_config(spec: str | None, model_dir: Path) -> SpeculativeConfig | None:
    """--speculative-config, checked against the checkpoint's params.json before any weight is loaded."""
    if spec is None:
        return None
    try:
        return SpeculativeConfig.parse(spec, ModelConfig.load(model_dir))
    except ValueError as e:
        raise SystemExit(f"--speculative-config: {e}") from None


def parallel_config(args: argparse.Namespace, model_dir: Path) -> ParallelConfig | None:
    """-tp / -dcp / --dcp-interleave / --dcp-timeout (None: one rank), the TP split checked against the
    checkpoint before any rank process starts."""
    try:
        cfg = ParallelConfig(args.tensor_parallel_size, args.decode_context_parallel_size, args.dcp_interleave,
                             args.dcp_timeout)
    except ValueError as e:
        field = str(e).split(":")[0]
        raise SystemExit(f"--{PARALLEL_FLAGS.get(field, field.replace('_', '-'))}: {e}") from None
    if cfg.tp_size > 1:
        try:
            check_splits(ModelConfig.load(model_dir), cfg.tp_size)
        except ValueError as e:
            raise SystemExit(f"--tensor-parallel-size: {e}") from None
    return cfg if cfg.world_size > 1 else None
