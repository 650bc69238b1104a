"""Engine state as Prometheus metrics, read on scrape.

NOTE: the engine belongs to its thread; `collect` reads it there (`EngineLoop.call`), between
two steps, so that the numbers of one scrape agree with each other. A scrape waits for at most
one step; if the engine is gone or too slow the engine series are left out of that scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @classmethod
    def read(cls, engine: LLMEngine) -> EngineSnapshot:
        bm = engine.block_manager
        return cls(
            num_requests_running=len(engine.scheduler.running),
            num_requests_waiting=len(engine.scheduler.waiting),
            kv_cache_usage_perc=engine.kv_usage().usage_perc,
            num_preemptions=engine.scheduler.num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
        )


class EngineCollector(Collector):
    """vLLM's engine gauges and counters for the engine behind `loop`."""

    def __init__(self, loop: EngineLoop, model_name: str, timeout_s: float = 2.0) -> None:
        self.loop = loop
        self.model_name = model_name
        self.timeout_s = timeout_s

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        try:
            snapshot = self.loop.call(EngineSnapshot.read, timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail for this
            log.warning("engine metrics unavailable: %r", exc)
            return iter(())
        return self._families(snapshot)

    def _families(self, s: EngineSnapshot | None) -> Iterator[Metric]:
        labels = ["model_name"]
        values = [self.model_name]
        gauges = [
            ("num_requests_running", "Requests in the running batch.", "num_requests_running"),
            ("num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
            (
                "kv_cache_usage_perc",
                "Fraction of KV blocks in use (1 = full).",
                "kv_cache_usage_perc",
            ),
        ]
        for name, doc, field in gauges:
            gauge = GaugeMetricFamily(f"splitserve:{name}", doc, labels=labels)
            if s is not None:
                gauge.add_metric(values, getattr(s, field))
            yield gauge
        counters = [
            ("num_preemptions", "Sequences preempted (recomputed later).", "num_preemptions"),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
        ]  # fmt: skip
        for name, doc, field in counters:
            counter = CounterMetricFamily(f"splitserve:{name}", doc, labels=labels)
            if s is not None:
                counter.add_metric(values, getattr(s, field))
            yield counter
