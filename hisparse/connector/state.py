"""The two halves of HiSparseConnector's state, free of vLLM's connector plumbing.

Scheduler half (`AdmissionState`): every live request reserves prompt + max new tokens of host-pool capacity
when vLLM allocates it; a request that would overflow the pool waits. Worker half (`WorkerState`): this
worker's LatentKV (host pool + working set), the map from vLLM's requests to hisparse's, and the stats deltas.
A request is known to the worker by the first KV block vLLM gave it: blocks are exclusive per live request
(prefix caching is off), and the batch's attention metadata lists each request's blocks in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.settings import KVSettings
from ..kv.hisparse_kv import HiSparseKV
from ..core.batch import Segment, segment_positions
from ..core.config import ModelConfig
from ..kv.base import KVStats
from .footprint import release_profile_hold
from .settings import HiSparseConfigError


@dataclass
class StepPlan:
    """Scheduler -> worker, once per step: requests to forget, then requests to start (or restart)."""
    released: list[str] = field(default_factory=list)              # finished, aborted or preempted
    admitted: list[tuple[str, int, int]] = field(default_factory=list)   # (req id, first block id, tokens)


class AdmissionState:
    """Host-pool reservations of live requests (scheduler side), in tokens."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.capacity: int | None = None          # set from the workers' handshake (None: unbounded)
        self.page_tokens = 1                      # the pool's allocation unit, also from the handshake
        self.reserved: dict[str, int] = {}

    def need(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Tokens to reserve, rounded up to whole pages as the worker's LatentKV.reserve counts them."""
        n = min(num_prompt_tokens + (max_tokens or 0), self.max_model_len)
        return -(-n // self.page_tokens) * self.page_tokens

    def fits(self, req_id: str, tokens: int) -> bool:
        if self.capacity is None:
            return True
        others = sum(v for k, v in self.reserved.items() if k != req_id)
        return others + tokens <= self.capacity

    def allocate(self, req_id: str, tokens: int) -> None:
        self.reserved[req_id] = tokens

    def plan(self, started: list[tuple[str, int]], released: set[str]) -> StepPlan:
        """started: (req id, first block id) of requests scheduled from position 0 this step (new or resumed
        after preemption); released: finished, aborted or preempted since the last step."""
        return StepPlan(sorted(released), [(r, block, self.reserved[r]) for r, block in started])

    def finish(self, req_id: str) -> None:
        self.reserved.pop(req_id, None)


class WorkerState:
    """One worker's latent store and its view of vLLM's batch."""

    def __init__(self, cfg: ModelConfig, settings: KVSettings, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, limits: tuple[int, int] | None = None):
        """limits: (max_num_seqs, max_num_batched_tokens): the device stores are allocated for them now, before
        vLLM sizes its cache; they take the place of the bytes the profile run held (`connector.footprint`)."""
        release_profile_hold()
        self.kv = settings.build(cfg, device, dtype)
        if limits is not None:
            self.kv.reserve_device(limits[0], max_model_len, limits[1])
        cap = self.kv.token_capacity()
        if cap is not None and cap < max_model_len:
            raise HiSparseConfigError(
                f"kv_connector_extra_config: 'host_pool_gib' = {settings.host_pool_gib} holds {cap} tokens, fewer "
                f"than max_model_len = {max_model_len}; raise host_pool_gib or lower --max-model-len")
        self.req_of_block: dict[int, str] = {}
        self.block_of_req: dict[str, int] = {}
        self.reported = KVStats()

    def apply(self, plan: StepPlan) -> None:
        for req_id in plan.released:
            self.release(req_id)
        for req_id, block, tokens in plan.admitted:
            self.release(req_id)                   # a resumed request recomputes from position 0
            if not self.kv.reserve(req_id, tokens):
                raise RuntimeError(f"hisparse: request {req_id} ({tokens} tokens) does not fit the host pool "
                                   f"({self.kv.tokens_unreserved()} tokens unreserved)")
            self.req_of_block[block] = req_id
            self.block_of_req[req_id] = block

    def release(self, req_id: str) -> None:
        block = self.block_of_req.pop(req_id, None)
        if block is not None:
            self.kv.release(req_id)
            if self.req_of_block.get(block) == req_id:
                del self.req_of_block[block]

    def segments(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 positions: torch.Tensor) -> list[Segment]:
        """One Segment per request of vLLM's batch (batch order); checks them against vLLM's positions [N]."""
        n = seq_lens.numel()
        lengths = (query_start_loc[1:n + 1] - query_start_loc[:n]).tolist()
        starts = (seq_lens[:n] - query_start_loc[1:n + 1] + query_start_loc[:n]).tolist()
        firsts = block_table[:n, 0].tolist()
        unknown = [b for b in firsts if b not in self.req_of_block]
        if unknown:
            raise RuntimeError(f"hisparse: batch rows with first KV blocks {unknown} belong to no request the "
                               "connector admitted")
        segs = [Segment(self.req_of_block[b], s, t) for b, s, t in zip(firsts, starts, lengths)]
        if not torch.equal(segment_positions(segs, positions.device)[0], positions[: sum(lengths)].long()):
            raise RuntimeError("hisparse: vLLM's positions disagree with the request segments")
        return segs

    def stats(self) -> dict[str, int | float]:
        """Counter increments since the last call, and the current gauges."""
        now = self.kv.stats.snapshot()
        delta = {k: getattr(now, k) - getattr(self.reported, k) for k in vars(now)}
        self.reported = now
        pool = self.kv.pool if isinstance(self.kv, HiSparseKV) else None
        return {**delta, "host_pool_usage": self.kv.usage_ratio(),
                "host_pool_reserved_tokens": sum(self.kv.reserved.values()),
                "host_pool_capacity_tokens": self.kv.token_capacity() or 0,
                "host_pool_pages_used": pool.pages_used if pool is not None else 0,
                "live_requests": len(self.block_of_req)}
