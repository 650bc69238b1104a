"""What tracing costs a request when it is off (the default), against on with an in-memory
exporter, measured in the same run (CPU: tracing is host-side work).

    python -m bench.tracing_overhead [--spans-per-request 64] [--out F]

A request makes a few spans per service plus one per prefill chunk; 64 spans per request is a
generous bound. The per-request cost is compared with a tiny model's end-to-end latency.
"""

from __future__ import annotations

import argparse
import statistics
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.common import device_name, table, write_results
from splitserve.runtime.tracing import Tracing


def per_span_us(tracing: Tracing, reps: int = 20000) -> float:
    def one_round() -> float:
        start = time.perf_counter()
        for _ in range(reps):
            span = tracing.start("prefill.chunk", None)
            if span.is_recording():
                span.set_attribute("splitserve.chunk.tokens", 128)
            tracing.metadata(span)
            span.end()
        return (time.perf_counter() - start) / reps * 1e6

    return statistics.median(one_round() for _ in range(5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans-per-request", type=int, default=64)
    parser.add_argument(
        "--request-ms",
        type=float,
        default=100.0,
        help="end-to-end latency to compare with (tiny model on CPU: ~100 ms)",
    )
    parser.add_argument("--out", default="bench/results/tracing_overhead.json")
    args = parser.parse_args()
    off = Tracing.disabled()
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    on = Tracing(provider.get_tracer("bench"), provider)
    rows = []
    for name, tracing in (("off (default)", off), ("on, in-memory export", on)):
        us = per_span_us(tracing)
        per_request = us * args.spans_per_request
        rows.append(
            {
                "tracing": name,
                "us per span": us,
                "us per request": per_request,
                "% of request": 100 * per_request / (args.request_ms * 1e3),
            }
        )
        exporter.clear()
    write_results(
        args.out,
        {
            "benchmark": "tracing_overhead",
            "device": device_name(),
            "spans_per_request": args.spans_per_request,
            "request_ms": args.request_ms,
            "rows": rows,
        },
    )
    print(
        f"{device_name()}: {args.spans_per_request} spans per request, "
        f"request latency {args.request_ms} ms"
    )
    print(table(rows, ["tracing", "us per span", "us per request", "% of request"]))


if __name__ == "__main__":
    main()
