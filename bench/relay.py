"""Relay benchmark (issue 26): the output tokens/s the gateway relays, apart from any GPU.

    python -m bench.relay                                   # 1 and 4 processes, intervals 1,4,16
    python -m bench.relay --processes 1,2,4,8 --intervals 1,2,4,8,16 --streams 512 --clients 8
    python -m bench.relay --smoke                           # CPU, seconds: checks that it runs
    python -m bench.relay --processes 1 --intervals 1 --intervals-ms 0,20,50 --step-ms 10

Everything is real but the workers' compute: a real `redis-server`, the real `splitserve gateway
--processes N` (its own processes), and fake decode and prefill workers (`bench/relay_fakes.py`:
real gRPC servers on loopback, registered in Redis as real workers are) that send tokens as fast
as the gateway reads them. Client processes (`bench/relay_client.py`) hold `--streams`
concurrent Generate streams (512-token replies, asked again as soon as one ends) through the
public gRPC API and count the tokens that arrive inside a measured window; meanwhile the gateway
processes' CPU time is read from /proc. Per (processes, stream_interval, stream_interval_ms):
output tokens/s, client messages/s and messages per token, gateway CPU cores used, tokens/s per
gateway core — the number that sizes the gateway (docs/deploy.md) — and p50/p99 of the gaps
between a stream's consecutive token messages as its client sees them, and of its inter-token
latency (a message's gap spread over its tokens). The clients and fakes share the host's cores
with the gateway: on a small host they limit the total, which is why tokens/s per core is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench.common import table, write_results
from bench.proc_cpu import CPUMeter
from bench.relay_client import GAP_BUCKETS_PER_S
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.launch.up import free_port


def wait_serving(proc: subprocess.Popen[str], processes: int, timeout_s: float) -> None:
    """Until every gateway process serves (the group's line, or the one process's), relaying
    the gateway's output as ours; RuntimeError if it exits or takes longer than `timeout_s`.
    (A health check on the shared port would answer from whichever process the kernel picked.)"""
    ready = threading.Event()
    mark = f"with {processes} processes" if processes > 1 else " serving on "

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if mark in line:
                ready.set()
            print(line, end="", flush=True)

    threading.Thread(target=relay, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited during start-up ({proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway was not serving within {timeout_s:.0f} s")


def _gateway(
    args: argparse.Namespace,
    redis_url: str,
    model: str,
    processes: int,
    interval: tuple[int, int],
    decode_many: bool,
):
    port = free_port("127.0.0.1")
    cmd = [
        sys.executable, "-m", "splitserve.cli", "gateway", "--model", model,
        "--redis-url", redis_url, "--port", str(port), "--processes", str(processes),
        "--stream-interval", str(interval[0]), "--stream-interval-ms", str(interval[1]),
        "--max-inflight", str(max(256, args.streams * 2)),
        "--drain-timeout-s", "2", "--decode-many", str(decode_many).lower(),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, text=True)
    wait_serving(proc, processes, timeout_s=120.0)
    return proc, f"127.0.0.1:{port}"


def run_one(
    args: argparse.Namespace,
    redis_url: str,
    model: str,
    processes: int,
    interval: tuple[int, int],
    decode_many: bool = True,
) -> dict[str, Any]:
    """One measured window; `interval`: the gateway's (--stream-interval, --stream-interval-ms);
    `decode_many`: its --decode-many (one call per fake decode worker, or one per stream)."""
    proc, address = _gateway(args, redis_url, model, processes, interval, decode_many)
    try:
        meter = CPUMeter({"gateway": proc.pid})  # and its processes
        start = time.time() + args.warmup_s
        end = start + args.seconds
        per_client = max(1, args.streams // args.clients)
        cmd = [
            sys.executable, "-m", "bench.relay_client", "--address", address,
            "--streams", str(per_client), "--start", str(start), "--end", str(end),
            "--max-tokens", str(args.max_tokens),
        ]  # fmt: skip
        clients = [
            subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(args.clients)
        ]
        time.sleep(max(0.0, start - time.time()))
        meter.start()
        t0 = time.monotonic()
        time.sleep(max(0.0, end - time.time()))
        cores = sum(meter.stop().values())
        t1 = time.monotonic()
        seen: dict[str, int] = {}
        hists: dict[str, dict[int, int]] = {"gap_hist": {}, "itl_hist": {}}
        for client in clients:
            out, _ = client.communicate(timeout=120)
            for key, value in json.loads(out.strip().splitlines()[-1]).items():
                if key in hists:
                    for bucket, count in value.items():
                        hists[key][int(bucket)] = hists[key].get(int(bucket), 0) + count
                else:
                    seen[key] = seen.get(key, 0) + value
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    window = t1 - t0
    tokens_s = seen.get("tokens", 0) / window
    messages = seen.get("messages", 0)
    return {
        "processes": processes,
        "decode_many": "on" if decode_many else "off",
        "stream_interval": interval[0],
        "stream_interval_ms": interval[1],
        "streams": per_client * args.clients,
        "tokens_per_s": tokens_s,
        "messages_per_s": messages / window,
        "messages_per_token": messages / seen["tokens"] if seen.get("tokens") else 0.0,
        "requests_per_s": seen.get("requests", 0) / window,
        "gateway_cores": cores,
        "tokens_per_s_per_core": tokens_s / cores if cores > 0 else 0.0,
        "gap_p50_ms": gap_quantile_ms(hists["gap_hist"], 0.50),
        "gap_p99_ms": gap_quantile_ms(hists["gap_hist"], 0.99),
        "itl_p50_ms": gap_quantile_ms(hists["itl_hist"], 0.50),
        "itl_p99_ms": gap_quantile_ms(hists["itl_hist"], 0.99),
        "errors": {k: v for k, v in seen.items() if k.startswith("error_")},
    }


def gap_quantile_ms(hist: dict[int, int], q: float) -> float:
    """The `q` quantile (upper bucket edge, ms) of the clients' merged gap (or inter-token
    latency) histograms (bench/relay_client.py); 0.0 if none was seen."""
    total = sum(hist.values())
    if not total:
        return 0.0
    rank, seen = q * total, 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= rank:
            return (bucket + 1) * 1000 / GAP_BUCKETS_PER_S
    raise AssertionError("unreachable")  # pragma: no cover


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,4", help="gateway process counts")
    parser.add_argument("--intervals", default="1,4,16", help="stream_interval values")
    parser.add_argument(
        "--intervals-ms", default="0", help="stream_interval_ms values (each with each interval)"
    )
    parser.add_argument("--streams", type=int, default=256, help="concurrent client streams")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--decode", type=int, default=2, help="fake decode workers")
    parser.add_argument("--fake-processes", type=int, default=2, help="processes of fakes")
    parser.add_argument("--tokens-per-message", type=int, default=1, help="from each fake D")
    parser.add_argument(
        "--step-ms", type=float, default=0.0,
        help="fake decode step: a token per stream per step, what queued sent as one message "
        "(0: as fast as the gateway reads)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-many", default="on", help="the gateway's --decode-many: on, off or both (on,off)"
    )
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--smoke", action="store_true", help="tiny and short (CPU check)")
    parser.add_argument("--out", default="bench/results/relay.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.processes, args.intervals = "2", "1,4"
        args.streams, args.clients, args.decode, args.fake_processes = 8, 1, 1, 1
        args.max_tokens, args.seconds, args.warmup_s = 64, 1.5, 1.0
    from splitserve.testing.tiny_model import make_tiny_model

    rows = []
    # NOTE: the gateway needs a model's config and tokenizer only: a tiny one will do.
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis:
        model = str(make_tiny_model(tmp))
        fake_cmd = [
            sys.executable, "-m", "bench.relay_fakes", "--redis-url", redis.url,
            "--decode", str(max(1, args.decode // args.fake_processes)),
            "--prefill", "1", "--tokens-per-message", str(args.tokens_per_message),
            "--step-ms", str(args.step_ms),
        ]  # fmt: skip
        fakes = [
            subprocess.Popen(
                [*fake_cmd, "--id-prefix", f"p{i}-"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(args.fake_processes)
        ]
        try:
            for fake in fakes:
                assert fake.stdout is not None
                if fake.stdout.readline().strip() != "ready":
                    raise RuntimeError("the fake workers did not start")
            for processes, interval, many in (
                (int(p), (int(i), int(ms)), many == "on")
                for p in args.processes.split(",")
                for i in args.intervals.split(",")
                for ms in args.intervals_ms.split(",")
                for many in args.decode_many.split(",")
            ):
                row = run_one(args, redis.url, model, processes, interval, many)
                rows.append(row)
                print(table([row], COLUMNS).splitlines()[-1], flush=True)
        finally:
            for fake in fakes:
                fake.terminate()
                fake.wait(30)
    results = {
        "benchmark": "relay",
        "host_cpus": os.cpu_count(),
        "workload": f"{args.streams} streams, {args.max_tokens}-token replies, fake workers "
        f"({args.decode} decode, {args.tokens_per_message} token(s) per worker message, "
        f"step {args.step_ms:g} ms)",
        "rows": rows,
    }
    print(table(rows, COLUMNS))
    write_results(args.out, results)
    return results


COLUMNS = [
    "processes", "decode_many", "stream_interval", "stream_interval_ms", "streams", "tokens_per_s",
    "messages_per_s", "messages_per_token", "gateway_cores", "tokens_per_s_per_core",
    "gap_p50_ms", "gap_p99_ms", "itl_p50_ms", "itl_p99_ms",
]  # fmt: skip


if __name__ == "__main__":
    main()
