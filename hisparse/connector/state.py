"""The two halves of HiSparseConnector's state, free of vLLM's connector plumbing.

Scheduler half (`AdmissionState`): every live request reserves prompt + max new tokens of host-pool capacity
when vLLM allocates it; a request that would overflow the pool waits. With prefix caching it also decides which
cached units a request starts from, which units are cached and which are evicted (`prefix_index`); the workers
replay those decisions from the step plan. Worker half (`WorkerState`): this
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
from .prefix_index import PrefixIndex
from .settings import HiSparseConfigError


@dataclass
class StepPlan:
    """Scheduler -> worker, once per step: what changed since the last plan, in the order it happened.

    ("release", req)                                 finished, aborted or preempted: free its rows
    ("cache", req, first, keys)                      its units first, first + 1, ... are written: cache them
    ("evict", keys)                                  forget these parked cached units (room for an admission)
    ("admit", req, block, tokens, keys, queried)     start (or restart) req, known by its first KV block, from the
                                                     cached units `keys`, reserving `tokens` (`queried`: prompt
                                                     tokens it looked up)
    """
    ops: list[tuple] = field(default_factory=list)


class AdmissionState:
    """Host-pool reservations of live requests (scheduler side), in tokens, and with prefix caching the index of
    the workers' caches (`prefix_index.PrefixIndex`), whose parked units take room until evicted."""

    def __init__(self, max_model_len: int, caching: bool = False, salt: bytes = b""):
        self.max_model_len, self.caching, self.salt = max_model_len, caching, salt
        self.capacity: int | None = None          # set from the workers' handshake (None: unbounded)
        self.page_tokens = 1                      # the pool's allocation unit, also from the handshake
        self.reserved: dict[str, int] = {}
        self.index: PrefixIndex | None = None     # built at the handshake (its unit is the workers' page)
        self.log: list[tuple] = []                # ops since the last plan
        self.prompts: dict[str, list[int]] = {}   # live request -> prompt token ids
        self.progress: dict[str, int] = {}        # live request -> positions written once its last step has run
        self.cached_units: dict[str, int] = {}    # live request -> its units cached (or started from) so far

    def handshake(self, capacity: int | None, page_tokens: int) -> None:
        self.capacity, self.page_tokens = capacity, page_tokens
        if self.caching:
            self.index = PrefixIndex(page_tokens, self.salt)

    def need(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Tokens to reserve, rounded up to whole pages as the worker's LatentKV.reserve counts them."""
        n = min(num_prompt_tokens + (max_tokens or 0), self.max_model_len)
        return -(-n // self.page_tokens) * self.page_tokens

    def match(self, req_id: str, prompt: list[int]) -> list[bytes]:
        """The cached units a waiting request would start from (nothing changes)."""
        return self.index.match(req_id, prompt) if self.index is not None else []

    def fits(self, req_id: str, tokens: int) -> bool:
        """Whether the request's reservation fits (evicting parked units if need be)."""
        if self.capacity is None:
            return True
        others = sum(v for k, v in self.reserved.items() if k != req_id)
        return others + tokens <= self.capacity

    def allocate(self, req_id: str, tokens: int, prompt: list[int] | None = None) -> int:
        """Admit the request: it holds its matched units, parked units are evicted until the reservations and the
        parked units fit the pool, and its reservation is made. Tokens it starts from."""
        keys = self.match(req_id, prompt) if prompt is not None else []
        if self.index is not None:
            self.index.hold(req_id, keys)
            if self.capacity is not None:
                room = self.capacity - sum(v for k, v in self.reserved.items() if k != req_id) - tokens
                evicted = self.index.evict(len(self.index.parked) - max(0, room) // self.page_tokens)
                if evicted:
                    self.log.append(("evict", evicted))
        self.reserved[req_id] = tokens
        self.prompts[req_id] = list(prompt or ())
        self.progress[req_id] = len(keys) * self.page_tokens
        self.cached_units[req_id] = len(keys)
        self.log.append(("admit", req_id, None, tokens, keys, max(0, len(prompt or ()) - 1)))
        return len(keys) * self.page_tokens

    def written(self, req_id: str) -> None:
        """Cache the request's prompt units that its steps so far have written (the index first, then the
        workers through the log)."""
        if self.index is None or req_id not in self.prompts:
            return
        prompt, first = self.prompts[req_id], self.cached_units[req_id]
        done = min(self.progress[req_id], len(prompt)) // self.page_tokens
        if done > first:
            keys = self.index.chain(req_id, prompt)[first:done]
            self.index.add(req_id, keys)
            self.log.append(("cache", req_id, first, keys))
            self.cached_units[req_id] = done

    def release(self, req_id: str) -> None:
        """A request finished or was preempted: cache what it wrote, then free it."""
        self.written(req_id)
        if self.index is not None:
            self.index.release(req_id)
        for d in (self.reserved, self.prompts, self.progress, self.cached_units):
            d.pop(req_id, None)
        self.log.append(("release", req_id))

    def plan(self, started: list[tuple[str, int]], scheduled: dict[str, tuple[int, int]]) -> StepPlan:
        """started: (req id, first block id) of requests admitted this step (new or resumed after preemption);
        scheduled: req id -> (positions written before this step, tokens this step) of every scheduled request.
        The units earlier steps wrote are cached now (those steps have run when the workers apply the plan)."""
        for req_id, (computed, n) in scheduled.items():
            if req_id in self.progress:
                self.written(req_id)
                self.progress[req_id] = computed + n
        block = dict(started)
        ops = [("admit", op[1], block[op[1]], *op[3:]) if op[0] == "admit" else op for op in self.log]
        self.log = []
        return StepPlan(ops)


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
        """Replay the scheduler's ops in order (the cache decisions are the scheduler's: nothing is evicted here
        that the plan does not name)."""
        for kind, *args in plan.ops:
            if kind == "release":
                self.release(*args)
            elif kind == "cache":
                self.kv.cache_units(*args)
            elif kind == "evict":
                self.kv.evict_units(*args)
            elif kind == "admit":
                self.admit(*args)
            else:
                raise RuntimeError(f"hisparse: unknown step-plan op {kind!r}")

    def admit(self, req_id: str, block: int, tokens: int, keys: list[bytes], queried: int) -> None:
        """Start a request (a resumed one from scratch) from the cached units `keys`, reserving `tokens`."""
        self.release(req_id)
        hit = self.kv.attach_units(req_id, keys)      # its units held first: they are not parked any more
        free = self.kv.tokens_unreserved()
        if free is not None and -(-tokens // self.kv.page_tokens) * self.kv.page_tokens > free:
            raise RuntimeError(f"hisparse: request {req_id} ({tokens} tokens) does not fit the host pool ({free} "
                               "tokens unreserved, parked cached pages not counted): the scheduler's plan "
                               "disagrees with this worker")
        self.kv.reserve(req_id, tokens)
        if self.kv.prefix_caching:
            self.kv.stats.prefix_queries += queried
            self.kv.stats.prefix_hits += hit
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
                "prefix_cache_pages": self.kv.cached_pages(),
                "live_requests": len(self.block_of_req)}
