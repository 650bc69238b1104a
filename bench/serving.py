"""Serving benchmark (DESIGN.md benchmark 4): open-loop Poisson load through the public API,
disaggregated (1 prefill + 1 decode worker) against colocated workers on the same GPUs.

    python -m bench.serving                         # Llama-3-8B shape, two GPUs, both configs
    python -m bench.serving --workloads 1024/128@4,12 4096/256@2 --sweep
    python -m bench.serving --smoke                 # CPU, tiny model: checks that it runs
    python -m bench.serving --phased --ratio-sweep  # four GPUs: static splits vs the planner

Each configuration is started as a real stack (`splitserve.launch.up`: redis-server, workers,
gateway, each its own process) on dummy weights of the shape. Requests are random token-id
prompts (no shared prefix), greedy, EOS ignored, sent at Poisson arrival times whether or not
earlier ones finished. Per run: TTFT, TPOT ((last token − first token) / (tokens − 1)) and ITL
(every gap between streamed tokens) at p50 / p90 / p99, output tokens/s, errors by status, and
the SLO attainment and goodput (requests meeting TTFT ≤ 1 s and TPOT ≤ 40 ms, per second of
arrivals). `--sweep` raises each configuration's rate ×1.5 from the lowest until fewer than 90%
of requests meet the SLO, and reports the highest rate that met it.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import serving_phased
from bench.common import model_dir, table, write_results
from bench.itl_gaps import write_records
from bench.proc_cpu import CPUMeter
from bench.serving_load import SLO_ATTAINMENT, SLO_TPOT_S, SLO_TTFT_S, Record, run_load
from splitserve.launch.up import Stack, StackSettings, start_stack

CONFIGS = {
    # name: (prefill workers, decode workers, devices handed out decode-first)
    "1P+1D": (1, 1, ("cuda:1", "cuda:0")),
    "2 colocated": (0, 2, ("cuda:0", "cuda:1")),
    # one GPU shared by both workers (give each a KV budget: --worker-args
    # --kv-cache-memory-bytes N): a decode worker's serving step on a host with one GPU; a
    # closed loop of fixed lengths keeps prefill to the short bursts between waves of streams
    "1P+1D one GPU": (1, 1, ("cuda:0", "cuda:0")),
    # one colocated worker: a decode worker's serving path (front, engine core process, the
    # gateway's relay) with its own prefills as the only other steps (the closed loop's waves)
    "1 colocated": (0, 1, ("cuda:0",)),
    # four GPUs
    "1P+3D": (1, 3, ("cuda:1", "cuda:2", "cuda:3", "cuda:0")),
    "2P+2D": (2, 2, ("cuda:2", "cuda:3", "cuda:0", "cuda:1")),
    "3P+1D": (3, 1, ("cuda:3", "cuda:0", "cuda:1", "cuda:2")),
    "4 colocated": (0, 4, ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
}


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: tuple[int, int]  # uniform in [low, high]
    output_len: tuple[int, int]

    rates: tuple[float, ...] = ()  # request rates to run it at (req/s); else --rates

    @classmethod
    def parse(cls, text: str) -> Workload:
        """`IN/OUT`, or `mixed`, optionally `@RATE,RATE…` (e.g. `1024/128@4,12`)."""
        name, _, rates = text.partition("@")
        parsed = tuple(float(r) for r in rates.split(",") if r)
        if name == "mixed":
            return cls("mixed", (128, 4096), (32, 512), parsed)
        prompt, out = (int(x) for x in name.split("/"))
        return cls(name, (prompt, prompt), (out, out), parsed)

    def requests(self, n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            prompt_len = rng.randint(*self.input_len)
            out.append(([rng.randrange(10, vocab) for _ in range(prompt_len)],
                        rng.randint(*self.output_len)))  # fmt: skip
        return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: list[Record], window: float) -> dict[str, Any]:
    ok = [r for r in records if r.status == "OK"]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if len(r.token_times) > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    tokens = sum(len(r.token_times) for r in ok)
    end = max((r.token_times[-1] for r in ok if r.token_times), default=0.0)
    first = min((r.sent for r in records), default=0.0)
    meeting = sum(r.meets_slo for r in records)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(Counter(r.status for r in records if r.status != "OK")),
        **{f"ttft_p{q}_s": _pct(ttft, q / 100) for q in (50, 90, 99)},
        **{f"tpot_p{q}_s": _pct(tpot, q / 100) for q in (50, 90, 99)},
        **{f"itl_p{q}_s": _pct(itl, q / 100) for q in (50, 90, 99)},
        "output_tokens_per_s": tokens / (end - first) if end > first else 0.0,
        "slo_attainment": meeting / len(records) if records else 0.0,
        "goodput_req_per_s": meeting / window if window > 0 else 0.0,
        "window_s": window,
    }


def _row(config: str, workload: str, rate: float, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": config, "in/out": workload, "req/s": rate,
        "ok": f"{s['ok']}/{s['requests']}",
        "TTFT p50/p90 ms": f"{s['ttft_p50_s'] * 1e3:.0f} / {s['ttft_p90_s'] * 1e3:.0f}",
        "TPOT p50 ms": round(s["tpot_p50_s"] * 1e3, 1),
        "ITL p99 ms": round(s["itl_p99_s"] * 1e3, 1),
        "out tok/s": round(s["output_tokens_per_s"]),
        "gw cores": s.get("gateway_cores", "-"),
        "SLO %": round(100 * s["slo_attainment"], 1),
        "goodput req/s": round(s["goodput_req_per_s"], 2),
        "errors": ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "-",
    }  # fmt: skip


STEP_SERIES = ("num_steps", "step_seconds", "num_step_seqs")


def step_counters(stack: Stack) -> dict[str, dict[str, float]]:
    """Each worker's serving-loop counters (its /metrics): steps, their seconds, sequences."""
    out = {}
    for name, port in stack.metrics_ports.items():
        if name == "gateway" or name.startswith("prefill"):
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        values = {s.name.removeprefix("splitserve:").removesuffix("_total"): s.value
                  for s in samples}  # fmt: skip
        out[name] = {k: values.get(k, 0.0) for k in STEP_SERIES}
        out[name]["buckets"] = {  # type: ignore[assignment]
            float(s.labels["le"]): s.value
            for s in samples
            if s.name == "splitserve:step_duration_seconds_bucket"
        }
    return out


def _step_quantile(before: dict, after: dict, q: float) -> float:
    """The bucket bound under which a share `q` of the run's steps fell (ms; inf if above all)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    return next(1e3 * b for b, c in zip(bounds, counts, strict=True) if c >= q * counts[-1])


def _step_quantile_est(before: dict, after: dict, q: float) -> float:
    """The share `q` of the run's steps, linear within its bucket (as Prometheus's
    histogram_quantile reads a histogram; ms)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    want, low, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= want:
            if bound == float("inf"):
                return 1e3 * low
            share = (want - below) / (count - below) if count > below else 1.0
            return 1e3 * (low + (bound - low) * share)
        low, below = bound, count
    return 1e3 * low


def _steps_over(before: dict, after: dict, bound_s: float) -> int:
    """The run's steps longer than `bound_s` (a bucket bound of the step histogram)."""
    if bound_s not in after or float("inf") not in after:
        return 0
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    return int(total - (after[bound_s] - before.get(bound_s, 0.0)))


def serving_steps(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per decode worker over a run: steps, mean batch, mean serving step (its loop's wall
    time per step: what the offline step is compared with)."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {k: 0.0 for k in STEP_SERIES})
        steps = a["num_steps"] - b["num_steps"]
        if steps <= 0:
            continue
        out[name] = {
            "steps": int(steps),
            "mean_batch": (a["num_step_seqs"] - b["num_step_seqs"]) / steps,
            "mean_step_ms": 1e3 * (a["step_seconds"] - b["step_seconds"]) / steps,
            "step_p50_ms_le": _step_quantile(b.get("buckets", {}), a.get("buckets", {}), 0.5),
            "step_p99_ms_le": _step_quantile(b.get("buckets", {}), a.get("buckets", {}), 0.99),
            "step_p50_ms": _step_quantile_est(b.get("buckets", {}), a.get("buckets", {}), 0.5),
            "step_p90_ms": _step_quantile_est(b.get("buckets", {}), a.get("buckets", {}), 0.9),
            # NOTE: a few long turns a window stall every stream yet stay under the p99
            "steps_over_25ms": _steps_over(b.get("buckets", {}), a.get("buckets", {}), 0.025),
        }
    return out


def _step_line(name: str, step: dict[str, float]) -> str:
    return (
        f"{name}: {step['steps']} steps, mean batch {step['mean_batch']:.1f}, mean serving "
        f"step {step['mean_step_ms']:.2f} ms (p50 ~{step['step_p50_ms']:.1f}, p90 "
        f"~{step['step_p90_ms']:.1f}, p99 <= {step['step_p99_ms_le']:g} ms; "
        f"{step['steps_over_25ms']} over 25 ms)"
    )


def _cpu_table(cores: dict[str, float]) -> str:
    """Cores per process (a worker's engine core is its child `name/<pid>`), busiest first."""
    rows = [{"process": n, "cores": c} for n, c in sorted(cores.items(), key=lambda x: -x[1])]
    return table(rows, ["process", "cores"]) if rows else ""


def _stack(args: argparse.Namespace, model: Path, config: str) -> Stack:
    prefill, decode, devices = CONFIGS[config]
    worker_args = ["--max-num-seqs", str(args.max_num_seqs), *args.worker_args]
    if not args.smoke:
        worker_args += ["--load-format", "dummy", "--max-model-len", str(args.max_model_len)]
    else:
        worker_args += ["--num-kv-blocks", "512", "--max-num-batched-tokens", "256"]
    return start_stack(
        StackSettings(
            model=str(model),
            prefill=prefill,
            decode=decode,
            devices=() if args.smoke else devices,
            extra_worker_args=tuple(worker_args),
            extra_gateway_args=tuple(args.gateway_args),
            startup_timeout_s=900.0,
            metrics=True,
            # NOTE: 0 is what `splitserve gateway` defaults to (sized to the host); a stack
            # started from code asks for one process unless told.
            gateways=getattr(args, "gateways", 0),
        )
    )


def bench_config(args: argparse.Namespace, model: Path, config: str, vocab: int) -> list[dict]:
    results = []
    stack = _stack(args, model, config)
    config = f"{config} {args.label}" if args.label else config
    try:
        warm = Workload.parse(args.workloads[0]).requests(4, vocab, seed=99)
        run_load(stack.address, warm, rate=100.0, seed=0, timeout_s=args.timeout_s)
        for spec in args.workloads:
            workload = Workload.parse(spec)
            workload_name = workload.name
            rates = list(workload.rates or args.rates)
            first_rates = len(rates)
            sweep_best = None
            i = 0
            while i < len(rates):
                rate = rates[i]
                n = max(args.min_requests, int(rate * args.duration_s))
                requests = workload.requests(n, vocab, seed=int(rate * 1000) + i)
                meter = CPUMeter({name: stack.process(name).pid for name in stack.ports})
                steps0 = step_counters(stack)
                meter.start()
                records, window = run_load(
                    stack.address, requests, rate, i, args.timeout_s, args.client_processes,
                    args.concurrency,
                )  # fmt: skip
                s = summarize(records, window)
                if args.records_out is not None:
                    write_records(args.records_out, rate, records, args.client_processes)
                s["cpu_cores"] = cores = meter.stop()
                s["serving_steps"] = serving_steps(steps0, step_counters(stack))
                for name, step in s["serving_steps"].items():
                    print(_step_line(name, step))
                gateway_cores = sum(c for n, c in cores.items() if n.startswith("gateway"))
                s["gateway_cores"] = round(gateway_cores, 3)
                s["out_tok_per_gateway_core"] = (
                    s["output_tokens_per_s"] / gateway_cores if gateway_cores else 0.0
                )
                print(_cpu_table(cores))
                results.append({"config": config, "workload": workload_name, "rate": rate, **s})
                print(table([_row(config, workload_name, rate, s)], list(_row("", "", 0, s))))
                if args.sweep:
                    if s["slo_attainment"] >= SLO_ATTAINMENT:
                        sweep_best = rate
                        if i == len(rates) - 1 and rate < args.max_rate:
                            rates.append(round(rate * 1.5, 2))
                    elif i >= first_rates - 1:
                        break
                i += 1
            if args.sweep:
                results.append({"config": config, "workload": workload_name, "sweep": True,
                                 "highest_rate_meeting_slo": sweep_best})  # fmt: skip
    finally:
        stack.stop()
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument(
        "--configs", nargs="+", choices=sorted(CONFIGS), default=["1P+1D", "2 colocated"],
        help="splits to run (the four-GPU ones: 1P+3D, 2P+2D, 3P+1D, 4 colocated)",
    )  # fmt: skip
    parser.add_argument(
        "--workloads", nargs="+", default=["1024/128@4,12", "4096/256@2"],
        help="IN/OUT or mixed, each optionally @RATE,RATE (req/s)",
    )  # fmt: skip
    parser.add_argument("--rates", nargs="+", type=float, default=[4.0, 12.0])
    parser.add_argument("--duration-s", type=float, default=20.0, help="arrivals per rate")
    parser.add_argument("--min-requests", type=int, default=40)
    parser.add_argument("--sweep", action="store_true", help="raise rates until the SLO fails")
    parser.add_argument("--max-rate", type=float, default=64.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--gateway-args", nargs="*", default=[])
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--concurrency", type=int, default=0,
        help="closed loop: keep this many requests in flight (the rate only sizes the run)",
    )  # fmt: skip
    parser.add_argument("--worker-args", nargs="*", default=[], help="more flags for every worker")
    parser.add_argument("--label", default="", help="added to the configurations' names")
    parser.add_argument(
        "--client-processes", type=int, default=1,
        help="load client processes (one Python client tops out near 10k tokens/s)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny load")
    parser.add_argument("--out", type=Path, default=Path("bench/results/serving.json"))
    parser.add_argument(
        "--records-out", type=Path, default=None,
        help="also write every request's send and token times (gzipped JSON lines, one per "
        "rate) here: where the long gaps between tokens fall in time (bench/itl_gaps.py)",
    )  # fmt: skip
    serving_phased.add_flags(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.workloads, args.rates, args.duration_s, args.min_requests = (
            ["48/8"], [4.0], 2.0, 6,
        )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from splitserve.testing.tiny_model import make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny", "llama")
            vocab = 500
        else:
            model = model_dir(args.shape, Path(tmp))
            vocab = 128000
        if args.ratio_sweep or args.phased:  # NOTE: one stack of role-switch workers
            return serving_phased.run(args, model, vocab)
        results = []
        for config in args.configs:
            results += bench_config(args, model, config, vocab)
    rows = [_row(r["config"], r["workload"], r["rate"], r) for r in results if "rate" in r]
    print("\n" + table(rows, list(rows[0])) if rows else "no runs")
    for r in results:
        if r.get("sweep"):
            print(f"{r['config']} {r['workload']}: highest rate meeting the SLO "
                  f"({SLO_ATTAINMENT:.0%} of requests with TTFT <= {SLO_TTFT_S} s and TPOT <= "
                  f"{SLO_TPOT_S * 1e3:.0f} ms): {r['highest_rate_meeting_slo']} req/s")  # fmt: skip
    result = {
        "benchmark": "serving",
        "shape": "tiny llama" if args.smoke else args.shape,
        "smoke": args.smoke,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S, "attainment": SLO_ATTAINMENT},
        "prompts": "random token ids, no shared prefix; greedy; EOS ignored",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
