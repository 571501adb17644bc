"""Prometheus metrics, updated from the engine thread after every step (prometheus-client is thread-safe)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.engine import StepStats
from ..kv.base import KVStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 40.0, 80.0)
ACCEPTANCE_LENGTH_BUCKETS = tuple(float(n) for n in range(1, 9))   # tokens emitted per verify: accepted + 1
# KVStats field -> exported counter (cumulative in KVStats; the counters advance by each step's difference)
KV_COUNTERS = {
    "hits": ("hisparse_cache_hits", "Selected latent rows already on the device"),
    "misses": ("hisparse_cache_misses", "Selected latent rows copied host -> device"),
    "resident_hits": ("hisparse_cache_resident_hits", "Selected latent rows read from resident device pages "
                                                      "(--kv-offload hybrid)"),
    "spilled_pages": ("hisparse_spilled_pages", "Resident device pages spilled to make room (--kv-offload hybrid)"),
    "host_to_device_bytes": ("hisparse_host_to_device_bytes", "Bytes copied from the host pool to the device"),
    "device_to_host_bytes": ("hisparse_device_to_host_bytes", "Bytes backed up from the device to the host pool"),
    "prefix_queries": ("hisparse_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_hits": ("hisparse_prefix_cache_hits", "Prompt tokens found in the prefix cache (their prefill skipped)"),
}


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("hisparse_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("hisparse_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.prompt_tokens = Counter("hisparse_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("hisparse_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("hisparse_request_success", "Finished requests by reason", ["finished_reason"],
                                registry=r)
        self.graph_steps = Counter("hisparse_cuda_graph_steps", "Forwards that ran through the decode CUDA "
                                   "graphs (--cuda-graph)", registry=r)
        self.preemptions = Counter("hisparse_num_preemptions", "Running requests preempted to free KV "
                                   "(they recompute later)", registry=r)
        self._preempted = 0
        self.ttft = Histogram("hisparse_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram("hisparse_time_per_output_token_seconds", "Time between output tokens",
                              registry=r, buckets=TPOT_BUCKETS)
        self.kv = {k: Counter(name, doc, registry=r) for k, (name, doc) in KV_COUNTERS.items()}
        self.pool_usage = Gauge("hisparse_host_pool_usage_ratio", "Fraction of the KV store reserved", registry=r)
        self.reserved = Gauge("hisparse_kv_reserved_tokens", "KV tokens reserved by admitted requests", registry=r)
        self.index_bytes = Gauge("hisparse_kv_index_cache_bytes", "Indexer-key bytes running requests hold on the "
                                 "device", registry=r)
        self.cached_pages = Gauge("hisparse_prefix_cache_pages", "Pages the prefix cache holds", registry=r)
        self.resident_rows = Gauge("hisparse_resident_rows", "Latent rows (positions x KV-owning layers) held in "
                                   "resident device pages (--kv-offload hybrid)", registry=r)
        self.residency = Histogram("hisparse_request_residency_ratio", "Fraction of a finished request's pages "
                                   "that were resident on the device", registry=r,
                                   buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0))
        self._last = KVStats()
        # speculative decoding (vLLM's spec_decode names; all zero when it is off)
        self.spec_drafts = Counter("hisparse_spec_decode_num_drafts", "Verify steps (one per request per step)",
                                   registry=r)
        self.spec_draft_tokens = Counter("hisparse_spec_decode_num_draft_tokens", "Draft tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("hisparse_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("hisparse_spec_decode_num_accepted_tokens_per_pos",
                                             "Verify steps that accepted the draft at this position (0-based)",
                                             ["position"], registry=r)
        self.spec_acceptance_length = Histogram("hisparse_spec_decode_acceptance_length",
                                                "Tokens per verify step: accepted drafts + the correction/bonus token",
                                                registry=r, buckets=ACCEPTANCE_LENGTH_BUCKETS)
        self.spec_mean_accepted = Gauge("hisparse_spec_decode_mean_accepted_tokens_per_step",
                                        "Mean drafts accepted per verify step since start", registry=r)
        self._spec_steps = self._spec_accepted = 0
        # decode context parallelism: each rank's host pool (label rank) and all ranks together (no samples
        # without DCP)
        self.rank_pool_usage = Gauge("hisparse_dcp_host_pool_usage_ratio",
                                     "Fraction of each DCP rank's host pool holding rows (pages in use)", ["rank"],
                                     registry=r)
        self.rank_pool_used = Gauge("hisparse_dcp_host_pool_used_tokens", "Token slots in use in each DCP rank's "
                                    "host pool (whole pages)", ["rank"], registry=r)
        self.rank_pool_cached = Gauge("hisparse_dcp_prefix_cache_tokens", "Token slots of each DCP rank's host pool "
                                      "that the prefix cache keeps (whole pages)", ["rank"], registry=r)
        self.rank_pool_capacity = Gauge("hisparse_dcp_host_pool_capacity_tokens",
                                        "Token slots of each DCP rank's host pool", ["rank"], registry=r)
        self.rank_misses = Gauge("hisparse_dcp_cache_misses", "Selected rows each DCP rank copied host -> device "
                                 "(cumulative)", ["rank"], registry=r)
        self.total_pool_usage = Gauge("hisparse_dcp_host_pool_total_usage_ratio",
                                      "Fraction of all DCP ranks' host pools holding rows", ["ranks"], registry=r)

    def observe(self, s: StepStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.generation_tokens)
        self.graph_steps.inc(s.graph_steps)
        for reason in s.finished:
            self.finished.labels(reason).inc()
        self.preemptions.inc(s.num_preemptions - self._preempted)
        self._preempted = s.num_preemptions
        for v in s.ttft:
            self.ttft.observe(v)
        for v in s.tpot:
            self.tpot.observe(v)
        for key, counter in self.kv.items():
            counter.inc(max(0, getattr(s.kv_stats, key) - getattr(self._last, key)))
        self._last = s.kv_stats
        self.pool_usage.set(s.kv_usage)
        self.reserved.set(s.kv_reserved_tokens)
        self.index_bytes.set(s.kv_index_cache_bytes)
        self.cached_pages.set(s.kv_cached_pages)
        self.resident_rows.set(s.kv_resident_rows)
        for v in s.residency:
            self.residency.observe(v)
        for rank, pool in enumerate(s.kv_ranks):
            self.rank_pool_usage.labels(str(rank)).set(pool.usage_ratio)
            self.rank_pool_used.labels(str(rank)).set(pool.used_tokens)
            self.rank_pool_cached.labels(str(rank)).set(pool.cached_tokens)
            self.rank_pool_capacity.labels(str(rank)).set(pool.capacity_tokens)
            self.rank_misses.labels(str(rank)).set(pool.stats.misses)
        if s.kv_ranks:
            cap = sum(p.capacity_tokens for p in s.kv_ranks)
            used = sum(p.used_tokens for p in s.kv_ranks)
            self.total_pool_usage.labels(str(len(s.kv_ranks))).set(used / cap if cap else 0.0)
        if s.spec_accepted:
            self.spec_drafts.inc(len(s.spec_accepted))
            self.spec_draft_tokens.inc(s.spec_draft_tokens)
            self.spec_accepted_tokens.inc(sum(s.spec_accepted))
            for pos in range(max(s.spec_accepted)):
                self.spec_accepted_per_pos.labels(str(pos)).inc(sum(n > pos for n in s.spec_accepted))
            for n in s.spec_accepted:
                self.spec_acceptance_length.observe(n + 1)
            self._spec_steps += len(s.spec_accepted)
            self._spec_accepted += sum(s.spec_accepted)
            self.spec_mean_accepted.set(self._spec_accepted / self._spec_steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
