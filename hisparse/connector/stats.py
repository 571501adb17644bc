"""HiSparse counters through vLLM's connector stats path: worker -> scheduler -> API server log and Prometheus.

Each step the worker reports the counter increments since its last report (hits, misses, bytes each way, ...)
and the current gauges (host pool usage, live requests). vLLM aggregates reports per logging interval, logs
them as "KV Transfer metrics: hisparse_cache_hits=..." and feeds Prometheus `hisparse_*` metrics on /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from .metric_names import COUNTERS, GAUGES, metric_name


@dataclass
class HiSparseConnectorStats(KVConnectorStats):
    """data: {counter: increment over the interval, gauge: latest value}."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "HiSparseConnectorStats":
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value if key in COUNTERS else value
        return HiSparseConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {metric_name(k): v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


class HiSparsePromMetrics(KVConnectorPromMetrics):
    """Counters `hisparse_<name>_total` and gauges `hisparse_<name>`, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        for name in map(metric_name, COUNTERS + GAUGES):   # a re-created stat logger registers them again
            collector = REGISTRY._names_to_collectors.get(name)
            if collector is not None:
                REGISTRY.unregister(collector)
        self.counters = {n: create_metric_per_engine(self._counter_cls(
            name=metric_name(n), documentation=f"HiSparse {n.replace('_', ' ')} (cumulative)", labelnames=labelnames),
            per_engine_labelvalues) for n in COUNTERS}
        self.gauges = {n: create_metric_per_engine(self._gauge_cls(
            name=metric_name(n), documentation=f"HiSparse {n.replace('_', ' ')}", labelnames=labelnames,
            multiprocess_mode="mostrecent"), per_engine_labelvalues) for n in GAUGES}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters:
                self.counters[name][engine_idx].inc(value)
            elif name in self.gauges:
                self.gauges[name][engine_idx].set(value)
