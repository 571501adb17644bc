"""Names of the connector's stats: keys of the per-step stats dict and their `hisparse_*` metric names.

Free of vLLM imports: tests use them without vLLM installed.
"""

from __future__ import annotations

from dataclasses import fields

from ..kv.base import KVStats

COUNTERS = tuple(f.name for f in fields(KVStats))          # hits, misses, host_to_device_bytes, ...
GAUGES = ("host_pool_usage", "host_pool_reserved_tokens", "host_pool_capacity_tokens", "host_pool_pages_used",
          "prefix_cache_pages", "live_requests")
PREFIX = "hisparse_"
# Names shared with `hisparse serve`'s /metrics, so one dashboard reads both.
METRIC_NAMES = {"hits": "cache_hits", "misses": "cache_misses", "host_pool_usage": "host_pool_usage_ratio",
                "prefix_queries": "prefix_cache_queries", "prefix_hits": "prefix_cache_hits"}


def metric_name(key: str) -> str:
    """Prometheus / log name of a stats key: hisparse_<name> (counters get Prometheus' _total suffix)."""
    return PREFIX + METRIC_NAMES.get(key, key)
