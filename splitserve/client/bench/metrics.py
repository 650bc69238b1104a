"""Figures from each request's timings, named as `vllm bench serve` names them.

Definitions (vLLM's): TTFT is the first streamed token's arrival less the send time; E2EL the
last token's arrival less the send time; TPOT a request's (E2EL − TTFT) / (output tokens − 1),
for requests of two or more tokens; ITL every gap between successive streamed chunks that carry
tokens (a chunk of several tokens is one gap: what a user sees). Means, medians, standard
deviations and percentiles (numpy's, linear between ranks) are over completed requests only, in
milliseconds. Goodput counts the completed requests that meet every SLO given.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds on CLOCK_MONOTONIC (the same clock in
    every process of a host, so client processes' results merge)."""

    sent: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def done(self) -> float:
        return self.sent + self.latency


def parse_goodput_item(text: str) -> tuple[str, float]:
    """`KEY:MS` (KEY one of ttft, tpot, e2el): an argparse type, so a bad spec is a usage
    error naming what is wrong."""
    key, sep, value = text.partition(":")
    if not sep or key not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY:MILLISECONDS with KEY one of {', '.join(SLO_METRICS)}"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of ms") from None
    if not ms > 0 or ms == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the SLO must be a positive number of ms")
    return key, ms


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return result.success and all(values[k] * 1000 <= ms for k, ms in slos_ms.items())


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 → "p99", 99.9 → "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def samples_ms(results: list[RequestResult], metric: str) -> list[float]:
    ok = [r for r in results if r.success]
    if metric == "ttft":
        return [r.ttft * 1000 for r in ok]
    if metric == "e2el":
        return [r.latency * 1000 for r in ok]
    if metric == "tpot":
        return [t * 1000 for r in ok if (t := r.tpot) is not None]
    return [gap * 1000 for r in ok for gap in r.itl]


def compute(
    results: list[RequestResult],
    duration_s: float,
    metrics: tuple[str, ...] = METRICS,
    percentiles: tuple[float, ...] = (99.0,),
    slos_ms: dict[str, float] | None = None,
) -> dict[str, float | int]:
    """The summary figures of one run (the keys `vllm bench serve` writes where it has them)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    out: dict[str, float | int] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slos_ms:
        out["request_goodput"] = sum(meets_slos(r, slos_ms) for r in ok) / duration
    for metric in metrics:
        values = samples_ms(results, metric) or [0.0]
        out[f"mean_{metric}_ms"] = float(np.mean(values))
        out[f"median_{metric}_ms"] = float(np.median(values))
        out[f"std_{metric}_ms"] = float(np.std(values))
        for p in percentiles:
            out[f"{percentile_key(p)}_{metric}_ms"] = float(np.percentile(values, p))
    return out
