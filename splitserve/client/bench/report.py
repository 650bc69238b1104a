"""One run's figures as a table on stdout, as JSON (`vllm bench serve`'s keys where they
overlap), and as PNG plots when matplotlib is installed (`pip install 'splitserve[bench]'`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from splitserve.client.bench.metrics import METRICS, RequestResult, percentile_key, samples_ms

NAMES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def table(run: dict[str, Any], metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> str:
    rate = run["request_rate"]
    rows: list[str] = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, digits: int = 2) -> None:
        text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        rows.append(f"{label:<40}{text:>10}")  # NOTE: vLLM's layout, 50 columns

    row("Backend:", run["backend"])
    row("Successful requests:", run["completed"])
    row("Failed requests:", run["failed"])
    row("Request rate configured (RPS):", "inf" if math.isinf(rate) else f"{rate:.2f}")
    row("Maximum request concurrency:", run["max_concurrency"] or "none")
    row("Benchmark duration (s):", run["duration"])
    row("Total input tokens:", run["total_input_tokens"])
    row("Total generated tokens:", run["total_output_tokens"])
    row("Request throughput (req/s):", run["request_throughput"])
    if "request_goodput" in run:
        row("Request goodput (req/s):", run["request_goodput"])
    row("Output token throughput (tok/s):", run["output_throughput"])
    row("Total token throughput (tok/s):", run["total_token_throughput"])
    row("Client CPU, busiest process (%):", 100 * max(run["client_cpu"]), 0)
    for metric in metrics:
        title, short = NAMES[metric]
        rows.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", run[f"mean_{metric}_ms"])
        row(f"Median {short} (ms):", run[f"median_{metric}_ms"])
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key[1:]} {short} (ms):", run[f"{key}_{metric}_ms"])
    rows.append("=" * 50)
    return "\n".join(rows)


def save(runs: list[dict[str, Any]], path: str) -> None:
    """One rate: its dict; several: a list of them, in the order the rates were given."""
    # NOTE: JSON has no infinity: an unbounded rate is written "inf", as vLLM writes it
    plain = [{**r, "request_rate": "inf" if math.isinf(r["request_rate"]) else r["request_rate"]}
             for r in runs]  # fmt: skip
    Path(path).write_text(json.dumps(plain[0] if len(plain) == 1 else plain, indent=2) + "\n")


def plot(
    runs: list[dict[str, Any]], results: list[list[RequestResult]], directory: str
) -> list[str]:
    """`latency_cdf.png` (each metric's CDF, a line per rate) and, with several rates and a
    --goodput, `goodput_vs_rate.png`. The paths written; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, metric in zip(axes.flat, METRICS, strict=True):
        for run, res in zip(runs, results, strict=True):
            values = sorted(samples_ms(res, metric))
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=f"rate {run['request_rate']}")
        if metric == "itl" and ax.has_data():
            ax.set_xscale("log")  # NOTE: gaps span a decode step to a whole prefill
        ax.set_xlabel(f"{NAMES[metric][1]} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{runs[0]['backend']} · {runs[0]['dataset_name']}")
    fig.tight_layout()
    written = [str(out / "latency_cdf.png")]
    fig.savefig(written[0], dpi=100)
    plt.close(fig)
    finite = [r for r in runs if "request_goodput" in r]
    if len(runs) > 1 and finite:
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = [r["request_rate"] if not math.isinf(r["request_rate"]) else None for r in finite]
        shown = [(x, r) for x, r in zip(rates, finite, strict=True) if x is not None]
        ax.plot([x for x, _ in shown], [r["request_goodput"] for _, r in shown], "o-",
                label="goodput")  # fmt: skip
        ax.plot([x for x, _ in shown], [r["request_throughput"] for _, r in shown], "s--",
                label="throughput")  # fmt: skip
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("requests/s")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(str(out / "goodput_vs_rate.png"))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
