"""The ML4 architecture as a vLLM model: hisparse's ML4 run over the HiSparseConnector's LatentKV.

vLLM keeps its OpenAI server, tokenizer, scheduler (continuous batching, chunked prefill, preemption), input
preparation and sampler. The model replaces vLLM's attention: each forward maps vLLM's batch to hisparse
segments (the connector knows which request owns which KV block) and runs ML4 — indexer, exact top-k,
resolver over resident rows / hot buffer / host pool, absorbed sparse MLA — through the connector worker's
LatentKV. vLLM has no CPU sparse-MLA backend, and its attention kernels never see ML4's latent rows.

`slots` is one vLLM attention layer that is never called: it gives vLLM a KV cache spec, so vLLM allocates
blocks per request (its block accounting and the request identity the connector maps) and builds the batch's
attention metadata (query_start_loc, seq_lens, block table) that the segments are read from.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.distributed import get_tp_group
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention

from ..parallel.group import RankGroup
from ..kv.settings import KVSettings
from ..core.batch import ForwardTrace
from ..core.config import ModelConfig
from ..model.ml4 import ML4
from ..model.weights import load_model
from ..parallel.tp import shard_for
from .connector import HiSparseConnector
from .footprint import device_footprint, hold_for_profile

logger = init_logger(f"vllm.{__name__}")   # under vLLM's logger, which has its handler

SLOT_HEAD_SIZE = 32   # smallest head size vLLM's CPU attention backend accepts; the slots hold no ML4 data


class HiSparseML4ForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.model_dir = vllm_config.model_config.model
        self.cfg = ModelConfig.load(self.model_dir)
        self.device = torch.get_default_device()   # vLLM builds the model under its target device and dtype
        with torch.device("meta"):
            self.ml4 = ML4(self.cfg)   # shapes and dtype only; load_weights streams the checkpoint into a new one
        self.slots = Attention(num_heads=1, head_size=SLOT_HEAD_SIZE, scale=1.0, num_kv_heads=1,
                               cache_config=vllm_config.cache_config, prefix=f"{prefix}slots.0")   # vLLM wants one layer index
        sc = vllm_config.scheduler_config
        self.footprint = device_footprint(
            self.cfg, KVSettings.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config),
            vllm_config.model_config.dtype, sc.max_num_seqs, vllm_config.model_config.max_model_len,
            sc.max_num_batched_tokens)
        logger.info("hisparse: device bytes of the latent store %s per request (working set + indexer keys of "
                    "max_model_len tokens), %s in all at max_num_seqs = %d (on a GPU counted in vLLM's memory "
                    "profile: vLLM's KV cache is sized from the memory left)", f"{self.footprint.per_request:,}",
                    f"{self.footprint.total:,}", sc.max_num_seqs)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ml4.tok_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """input_ids, positions [N] (vLLM's flat batch) -> hidden states [N, D] before the final norm."""
        if input_ids is None:
            raise ValueError("HiSparseML4ForCausalLM needs token ids (prompt embeddings are not supported)")
        out = torch.zeros(input_ids.shape[0], self.cfg.dim, dtype=self.ml4.dtype, device=input_ids.device)
        conn = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(conn, HiSparseConnector) or not conn.has_connector_metadata():
            if conn is None and out.device.type != "cpu":
                # vLLM's memory profile, before the connector and its store exist: hold the store's bytes
                hold_for_profile(self.footprint.total, out.device)
            return out   # vLLM's warm-up / profiling run: no request, nothing to compute
        meta = get_forward_context().attn_metadata[self.slots.layer_name]
        segments = conn.worker.segments(meta.query_start_loc, meta.seq_lens, meta.block_table, positions)
        n = sum(s.length for s in segments)
        last = self.cfg.n_layers - 1
        trace = ForwardTrace(tap_layers=(last,))   # the last layer's output = hidden states before the head
        self.ml4(input_ids[:n], segments, conn.worker.kv, logits_at=torch.empty(0, dtype=torch.long), trace=trace)
        out[:n] = trace.taps[last]
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and soft cap (fp32 logits)."""
        return self.ml4.head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load with hisparse's own loader (Mistral-native names, FP8 linears kept FP8, shape checks), not vLLM's
        tensor stream, so vLLM and hisparse run the very same weights. Under `--tensor-parallel-size` each worker
        loads its share, sharded as `hisparse serve -tp` shards it, its collectives in vLLM's TP group."""
        tp = get_tp_group()
        shard = None
        if tp.world_size > 1:
            shard = shard_for(RankGroup(tp.device_group, device=self.device))
        self.ml4 = load_model(self.model_dir, device=self.device, dtype=self.ml4.dtype, shard=shard)
        return {name for name, _ in self.named_parameters()}
