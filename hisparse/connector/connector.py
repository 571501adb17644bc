"""HiSparseConnector: vLLM's KV connector (v1 API) in front of hisparse's latent store.

Scheduler side: admission by host-pool capacity (a request reserves prompt + max new tokens when vLLM
allocates it; one that does not fit waits), and each step's plan of requests started and released.
Worker side: owns this worker's LatentKV (HiSparseKV: host pool + working set), applies the plan when vLLM
binds the step's metadata (frees every row of a finished, aborted or preempted request), maps vLLM's batch to
hisparse segments for the model, and reports `hisparse_*` stats. The model plugin writes and reads the latent
rows through that LatentKV during its forward (hisparse's indexer, resolver and sparse MLA), so the
layer-wise load/save hooks have nothing to move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform

from ..host_pool.prefix_cache import salt_of
from ..kv.settings import KVSettings
from ..core.config import ModelConfig
from .footprint import check_device_budget
from .state import AdmissionState, StepPlan, WorkerState
from .stats import HiSparseConnectorStats, HiSparsePromMetrics

logger = init_logger(f"vllm.{__name__}")   # under vLLM's logger, which has its handler


@dataclass
class HiSparseMetadata(KVConnectorMetadata):
    plan: StepPlan


@dataclass
class HiSparseHandshake(KVConnectorHandshakeMetadata):
    token_capacity: int | None     # tokens this worker's host pool holds (None: unbounded)
    page_tokens: int               # its allocation unit


class HiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        settings = KVSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        mc = vllm_config.model_config
        self.admission: AdmissionState | None = None
        self.worker: WorkerState | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.admission = AdmissionState(mc.max_model_len, settings.enable_prefix_caching,
                                            salt_of(mc.model, mc.dtype, settings))
        else:
            sc = vllm_config.scheduler_config
            device = torch.device(current_platform.device_type)
            self.worker = WorkerState(ModelConfig.load(mc.model), settings, mc.dtype, device, mc.max_model_len,
                                      (sc.max_num_seqs, sc.max_num_batched_tokens))
            if device.type == "cuda":
                check_device_budget(vllm_config.cache_config.gpu_memory_utilization, device)

    @property
    def requires_kv_delivery(self) -> bool:
        return False    # nothing is handed to another instance

    # ---------------------------------------------------------------- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, HiSparseMetadata)
        self.worker.apply(connector_metadata.plan)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Nothing to load: attention gathers its selected rows from the host pool during the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are per selection, inside the model's attention."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """The model writes each step's new latent rows through the LatentKV (eager host backup)."""

    def wait_for_save(self) -> None:
        """Backups are flushed by the LatentKV at the end of each forward."""

    def get_handshake_metadata(self) -> HiSparseHandshake:
        return HiSparseHandshake(self.worker.kv.token_capacity(), self.worker.kv.page_tokens)

    def get_kv_connector_stats(self) -> HiSparseConnectorStats | None:
        return HiSparseConnectorStats(data=self.worker.stats()) if self.worker is not None else None

    # ---------------------------------------------------------------- scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        caps = [m.token_capacity for m in metadata.values()]
        self.admission.handshake(None if not caps or None in caps else min(caps),
                                 max((m.page_tokens for m in metadata.values()), default=1))
        logger.info("hisparse: admitting requests while their prompt + max_tokens fit %s host-pool tokens",
                    self.admission.capacity)

    def _need(self, request) -> int:
        return self.admission.need(request.num_prompt_tokens, request.max_tokens)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt tokens of the request's cached units in the host pool (its prefill skips them; the
        workers attach them before the step, so nothing loads asynchronously); None (try again later) while
        the host pool cannot take the request."""
        if not self.admission.fits(request.request_id, self._need(request)):
            return None, False
        matched = len(self.admission.match(request.request_id, request.prompt_token_ids))
        return max(0, matched * self.admission.page_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.admission.allocate(request.request_id, self._need(request), request.prompt_token_ids)

    def build_connector_meta(self, scheduler_output) -> HiSparseMetadata:
        started = [(r.req_id, r.block_ids[0][0]) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        started += [(r, cached.new_block_ids[i][0][0]) for i, r in enumerate(cached.req_ids)
                    if r in cached.resumed_req_ids]
        for req_id in scheduler_output.preempted_req_ids or ():
            self.admission.release(req_id)
        n = scheduler_output.num_scheduled_tokens
        scheduled = {r.req_id: (r.num_computed_tokens, n[r.req_id]) for r in scheduler_output.scheduled_new_reqs}
        scheduled.update((r, (cached.num_computed_tokens[i], n[r])) for i, r in enumerate(cached.req_ids))
        return HiSparseMetadata(self.admission.plan(started, scheduled))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.admission.release(request.request_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # ---------------------------------------------------------------- stats plumbing (API server side)
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiSparseConnectorStats:
        return HiSparseConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
                           ) -> HiSparsePromMetrics:
        return HiSparsePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
