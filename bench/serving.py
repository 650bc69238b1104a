"""Serving benchmark (DESIGN.md benchmark 4): open-loop Poisson load through the public API,
disaggregated (1 prefill + 1 decode worker) against colocated workers on the same GPUs.

    python -m bench.serving                         # Llama-3-8B shape, two GPUs, both configs
    python -m bench.serving --workloads 1024/128@4,12 4096/256@2 --sweep
    python -m bench.serving --smoke                 # CPU, tiny model: checks that it runs

Each configuration is started as a real stack (`splitserve.up`: redis-server, workers, gateway,
each its own process) on dummy weights of the shape. Requests are random token-id prompts (no
shared prefix), greedy, EOS ignored, sent at Poisson arrival times whether or not earlier ones
finished. Per run: TTFT, TPOT ((last token − first token) / (tokens − 1)) and ITL (every gap
between streamed tokens) at p50 / p90 / p99, output tokens/s, errors by status, and the SLO
attainment and goodput (requests meeting TTFT ≤ 1 s and TPOT ≤ 40 ms, per second of arrivals).
`--sweep` raises each configuration's rate ×1.5 from the lowest until fewer than 90% of
requests meet the SLO, and reports the highest rate that met it.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.common import model_dir, table, write_results
from splitserve.client import stream
from splitserve.engine.sampling_params import SamplingParams
from splitserve.protos.v1 import gateway_pb2_grpc
from splitserve.up import Stack, StackSettings, start_stack

SLO_TTFT_S, SLO_TPOT_S, SLO_ATTAINMENT = 1.0, 0.040, 0.9
CONFIGS = {
    # name: (prefill workers, decode workers, devices handed out decode-first)
    "1P+1D": (1, 1, ("cuda:1", "cuda:0")),
    "2 colocated": (0, 2, ("cuda:0", "cuda:1")),
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


@dataclass
class Record:
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    status: str = "OK"

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0

    @property
    def meets_slo(self) -> bool:
        return self.status == "OK" and self.ttft <= SLO_TTFT_S and self.tpot <= SLO_TPOT_S


def _one(stub: Any, prompt: list[int], max_tokens: int, record: Record, timeout_s: float) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    record.sent = time.monotonic()
    try:
        for msg in stream(stub, prompt, params, timeout_s=timeout_s):
            if msg.HasField("chunk"):
                now = time.monotonic()
                record.token_times.extend([now] * max(1, len(msg.chunk.token_ids)))
    except grpc.RpcError as exc:
        record.status = exc.code().name  # type: ignore[attr-defined]
    if record.status == "OK" and len(record.token_times) != max_tokens:
        record.status = f"SHORT({len(record.token_times)}/{max_tokens})"


def run_load(
    address: str, requests: Sequence[tuple[list[int], int]], rate: float, seed: int,
    timeout_s: float,
) -> tuple[list[Record], float]:  # fmt: skip
    """Send `requests` at Poisson arrivals of `rate`/s (open loop); their records and the
    arrival window's length."""
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 16 << 20)]
    )
    stub = gateway_pb2_grpc.GatewayStub(channel)
    rng = random.Random(seed)
    records = [Record() for _ in requests]
    threads = []
    start = time.monotonic()
    due = start
    for (prompt, max_tokens), record in zip(requests, records, strict=True):
        due += rng.expovariate(rate)
        time.sleep(max(0.0, due - time.monotonic()))
        thread = threading.Thread(
            target=_one, args=(stub, prompt, max_tokens, record, timeout_s), daemon=True
        )
        thread.start()
        threads.append(thread)
    window = time.monotonic() - start
    for thread in threads:
        thread.join(timeout_s + 30)
    channel.close()
    return records, window


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
        "SLO %": round(100 * s["slo_attainment"], 1),
        "goodput req/s": round(s["goodput_req_per_s"], 2),
        "errors": ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "-",
    }  # fmt: skip


def _stack(args: argparse.Namespace, model: Path, config: str) -> Stack:
    prefill, decode, devices = CONFIGS[config]
    worker_args = ["--max-num-seqs", str(args.max_num_seqs)]
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
        )
    )


def bench_config(args: argparse.Namespace, model: Path, config: str, vocab: int) -> list[dict]:
    results = []
    stack = _stack(args, model, config)
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
                records, window = run_load(stack.address, requests, rate, i, args.timeout_s)
                s = summarize(records, window)
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
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
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
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny load")
    parser.add_argument("--out", type=Path, default=Path("bench/results/serving.json"))
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
