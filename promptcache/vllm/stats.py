"""The connector's counters in vLLM's own stats path: ``get_kv_connector_stats`` hands the
deltas since the last call to vLLM, which sums the scheduler's and the workers' and shows them
in its log and, through ``PromptcacheProm``, on its ``/metrics`` as ``vllm:promptcache_*``."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = {
    "lookups": "requests the connector looked up (scheduler)",
    "hit_requests": "requests whose prompt our tiers held beyond vLLM's own hit",
    "hit_tokens": "prompt tokens promised from our tiers beyond vLLM's own hit",
    "miss_requests": "requests our tiers held nothing more of",
    "loaded_blocks": "blocks copied from our cache into vLLM's paged KV",
    "loaded_bytes": "bytes copied from our cache into vLLM's paged KV",
    "load_errors": "blocks promised but not loadable (failed verification, evicted): recomputed",
    "saved_blocks": "new blocks saved from vLLM's paged KV into our cache",
    "saved_bytes": "bytes saved from vLLM's paged KV into our cache",
    "dropped_writes": "block writes a lower tier's full queue dropped",
    "damaged_blocks": "block files or values that failed their checksum or chained hash",
}


@dataclass
class PromptcacheStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Tally:
    """Counters one side of the connector adds to from its threads; ``take`` empties them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._data[k] += v

    def take(self) -> PromptcacheStats | None:
        with self._lock:
            data, self._data = self._data, dict.fromkeys(COUNTERS, 0)
        return PromptcacheStats(data=data) if any(data.values()) else None


class PromptcacheProm(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:promptcache_{k}", documentation=doc, labelnames=labelnames
                ),
                per_engine,
            )
            for k, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
