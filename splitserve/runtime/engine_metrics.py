"""Engine state as Prometheus metrics, read on scrape.

NOTE: the engine belongs to its thread; `collect` reads `LLMEngine.stats()` there
(`EngineLoop.call`), between two steps, so that the numbers of one scrape agree with each other.
A scrape waits for at most one step; if the engine is gone or too slow the engine series are
left out of that scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from splitserve.engine.stats import STEP_BUCKETS_S, EngineStats

log = logging.getLogger(__name__)

GAUGES = (
    ("num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)."),
    ("host_cache_blocks", "KV blocks held in the host-memory tier."),
)
COUNTERS = (
    ("num_preemptions", "Sequences preempted (recomputed later)."),
    ("num_prefill_tokens", "Tokens computed to fill KV (prompts, recomputes), not decoded."),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("spec_decode_num_drafts", "Speculative verifications (one per sequence per step)."),
    ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ("num_steps", "Engine steps of the serving loop."),
    ("step_seconds", "Wall seconds of the serving loop's steps (commands, step, outputs)."),
    ("num_step_seqs", "Sequences run, summed over steps (divided by steps: the mean batch)."),
    ("host_cache_hits", "KV blocks found in the host-memory tier by prefix lookups."),
    ("host_cache_bytes_saved", "Bytes copied from the GPU pool to the host tier."),
    ("host_cache_bytes_loaded", "Bytes copied from the host tier back to the GPU pool."),
    ("host_cache_copy_seconds", "Seconds the engine spent issuing host-tier copies."),
)


class EngineCollector(Collector):
    """vLLM's engine gauges and counters for the engine behind `loop`."""

    def __init__(
        self, stats: Callable[[float], EngineStats], model_name: str, timeout_s: float = 2.0
    ) -> None:
        """`stats(timeout_s)` reads the engine's (its core's) numbers."""
        self.stats = stats
        self.model_name = model_name
        self.timeout_s = timeout_s

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.stats(self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail for this
            log.warning("engine metrics unavailable: %r", exc)
            return iter(())
        return self._families(stats)

    def _families(self, s: EngineStats | None) -> Iterator[Metric]:
        labels, values = ["model_name"], [self.model_name]
        for name, doc in GAUGES:
            gauge = GaugeMetricFamily(f"splitserve:{name}", doc, labels=labels)
            if s is not None:
                gauge.add_metric(values, getattr(s, name))
            yield gauge
        for name, doc in COUNTERS:
            counter = CounterMetricFamily(f"splitserve:{name}", doc, labels=labels)
            if s is not None:
                counter.add_metric(values, getattr(s, name))
            yield counter
        per_pos = CounterMetricFamily(
            "splitserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of a proposal (0 first).",
            labels=[*labels, "position"],
        )
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos if s else ()):
            per_pos.add_metric([*values, str(position)], count)
        yield per_pos
        yield _step_histogram(labels, values, s)
        longest = GaugeMetricFamily(
            "splitserve:step_seconds_max",
            "The longest serving step since the worker started (seconds).",
            labels=labels,
        )
        if s is not None:
            longest.add_metric(values, s.step_seconds_max)
        yield longest


def _step_histogram(labels: list[str], values: list[str], s: EngineStats | None) -> Metric:
    """The serving loop's step times as a Prometheus histogram (cumulative buckets)."""
    family = HistogramMetricFamily(
        "splitserve:step_duration_seconds",
        "Wall seconds of each serving step (commands, step, outputs).",
        labels=labels,
    )
    if s is not None and s.step_bucket_counts:
        bounds = [*(f"{b:g}" for b in STEP_BUCKETS_S), "+Inf"]
        cumulative, total = [], 0
        for bound, count in zip(bounds, s.step_bucket_counts, strict=True):
            total += count
            cumulative.append((bound, total))
        family.add_metric(values, cumulative, sum_value=s.step_seconds)
    return family
