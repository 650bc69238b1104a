"""`splitserve bench serve`: load a running server and report TTFT, TPOT, ITL, end-to-end
latency, throughput and goodput (docs/benchmarks.md, "Benchmarking a running server").

The flags follow `vllm bench serve` where it has the same thing, so that a run against
splitserve and one against another server read alike. Torch is never loaded: the client needs
none, and its CPU is part of what it measures.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

DATASETS = ("random", "prefix-repetition", "multi-turn", "custom")


def _metric_list(text: str) -> tuple[str, ...]:
    from splitserve.client.bench.metrics import METRICS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(METRICS)}"
        )
    return names


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers such as 50,90,99") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each percentile must be in (0, 100]")
    return values


def _positive_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected requests/s or inf") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the rate must be positive (or inf)")
    return rate


def add_bench_commands(sub: Any, env: Mapping[str, str]) -> None:
    """Add `bench serve` to the `splitserve` command's subparsers."""
    from splitserve.client.bench.metrics import parse_goodput_item

    bench = sub.add_parser("bench", help="benchmark a running server")
    kinds = bench.add_subparsers(dest="bench_command", required=True, help="what to benchmark")
    p = kinds.add_parser(
        "serve",
        help="send a load to a running server (gRPC or OpenAI HTTP) and report its latencies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_argument_group("the server")
    where.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: splitserve's gateway at --address; openai: any OpenAI-compatible server's "
        "streaming /v1/completions at --base-url",
    )
    where.add_argument(
        "--address",
        default=env.get("SPLITSERVE_ADDRESS", "127.0.0.1:50051"),
        help="the gateway's gRPC address (or SPLITSERVE_ADDRESS)",
    )
    where.add_argument(
        "--base-url", help="the HTTP server's root, e.g. http://127.0.0.1:8000 (a /v1 ending "
        "is accepted)"
    )  # fmt: skip
    where.add_argument("--endpoint", default="/v1/completions", help="the completions path")
    where.add_argument(
        "--model", help="the model name sent over HTTP (default: the first of GET /v1/models)"
    )
    where.add_argument(
        "--api-key",
        default=env.get("SPLITSERVE_API_KEY") or env.get("OPENAI_API_KEY"),
        help="sent as 'authorization: Bearer <key>' (or SPLITSERVE_API_KEY, OPENAI_API_KEY)",
    )
    where.add_argument("--tls-ca-file", help="connect with TLS, trusting this CA (PEM)")
    where.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly each request's output length (servers that reject the field: "
        "--no-ignore-eos)",
    )
    where.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request")

    data = p.add_argument_group("the prompts (lengths in words: docs/benchmarks.md)")
    data.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random words; groups sharing a prefix; conversations whose history grows; "
        "your own prompts (--dataset-path)",
    )
    data.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    data.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    data.add_argument("--random-input-len", type=int, default=1024, help="random: prompt words")
    data.add_argument("--random-output-len", type=int, default=128, help="random: tokens asked for")
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len·(1−r), len·(1+r)]",
    )
    data.add_argument(
        "--prefix-repetition-prefix-len", type=int, default=256, help="words of each shared prefix"
    )
    data.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=256,
        help="words after it, each request's own",
    )
    data.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes (groups)"
    )
    data.add_argument(
        "--prefix-repetition-output-len", type=int, default=128, help="tokens asked for"
    )
    data.add_argument("--multi-turn-num-turns", type=int, default=4, help="turns per conversation")
    data.add_argument("--multi-turn-input-len", type=int, default=64, help="new words a turn")
    data.add_argument(
        "--multi-turn-output-len", type=int, default=64, help="tokens asked for a turn"
    )
    data.add_argument("--dataset-path", help='custom: a JSONL file of {"prompt", "output_tokens"}')
    data.add_argument(
        "--custom-output-len", type=int, default=256, help="custom: where a line gives none"
    )

    load = p.add_argument_group("the load")
    load.add_argument(
        "--request-rate",
        type=_positive_rate,
        nargs="+",
        default=[math.inf],
        help="requests (conversations) per second; inf: all at once; several values: one run "
        "each, in turn",
    )
    load.add_argument(
        "--arrival",
        choices=("poisson", "fixed"),
        default="poisson",
        help="poisson: random gaps (shape --burstiness); fixed: exactly 1/rate apart",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 Poisson, below 1 burstier, above steadier",
    )
    load.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at most")
    load.add_argument(
        "--num-warmups", type=int, default=0, help="requests sent first, left out of the figures"
    )
    load.add_argument(
        "--num-client-processes",
        type=int,
        default=1,
        help="client processes sharing the load (when one saturates a core)",
    )

    out = p.add_argument_group("the results")
    out.add_argument(
        "--percentile-metrics",
        type=_metric_list,
        default=("ttft", "tpot", "itl", "e2el"),
        help="which of ttft,tpot,itl,e2el to report (default: all four)",
    )
    out.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default=(99.0,),
        help="percentiles to report, comma-separated (default: 99; e.g. 50,90,99)",
    )
    out.add_argument(
        "--goodput",
        type=parse_goodput_item,
        nargs="+",
        metavar="KEY:MS",
        help="SLOs a request must meet to count in goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    out.add_argument("--save-result", action="store_true", help="write the figures as JSON")
    out.add_argument("--result-filename", help="default: splitserve-bench-<backend>-<time>.json")
    out.add_argument("--plot-dir", help="write latency CDFs (and goodput against rate) as PNG")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=bench_serve)


def _conversations(args: argparse.Namespace) -> list[Any]:
    from splitserve.client.bench import datasets

    n = args.num_prompts
    if args.dataset_name == "random":
        return datasets.random_dataset(
            n, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed
        )
    if args.dataset_name == "prefix-repetition":
        return datasets.prefix_repetition_dataset(
            n,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.seed,
        )
    if args.dataset_name == "multi-turn":
        return datasets.multi_turn_dataset(
            n,
            args.multi_turn_num_turns,
            args.multi_turn_input_len,
            args.multi_turn_output_len,
            args.seed,
        )
    if not args.dataset_path:
        raise ValueError("--dataset-name custom needs --dataset-path")
    return datasets.custom_dataset(args.dataset_path, n, args.custom_output_len)


def _check(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "random_input_len", "random_output_len", "multi_turn_num_turns",
                 "num_client_processes"):  # fmt: skip
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be positive")
    if args.backend == "openai" and not args.base_url:
        raise ValueError("--backend openai needs --base-url")


def bench_serve(args: argparse.Namespace) -> int:
    from splitserve.runtime.torchless import keep_torch_out

    keep_torch_out()  # NOTE: before the client's modules load: they need no torch

    from tqdm import tqdm

    from splitserve.client.bench import datasets, load, metrics, report
    from splitserve.client.bench.backends import Target, served_model

    _check(args)
    base_url = (args.base_url or "").rstrip("/").removesuffix("/v1")
    model = args.model or ""
    if args.backend == "openai" and not model:
        model = served_model(base_url, args.api_key)
    target = Target(
        backend=args.backend,
        address=args.address,
        base_url=base_url,
        endpoint=args.endpoint,
        model=model,
        api_key=args.api_key,
        tls_ca_file=args.tls_ca_file,
        ignore_eos=args.ignore_eos,
        timeout_s=args.request_timeout,
    )
    conversations = _conversations(args)
    count = datasets.requests_in(conversations)
    where = args.address if args.backend == "grpc" else f"{base_url}{args.endpoint}"
    print(f"{count} requests ({args.dataset_name}) to {where}", flush=True)
    if args.num_warmups > 0:
        firsts = [datasets.Conversation((c.turns[0],)) for c in conversations]
        warm = [(firsts[i % len(firsts)], 0.0) for i in range(args.num_warmups)]
        results, _, _ = load.run_load(target, warm, args.max_concurrency)
        bad = [r.error for r in results if not r.success]
        print(f"warm-up: {len(warm) - len(bad)} of {len(warm)} requests completed", flush=True)
        if len(bad) == len(warm):
            print(
                f"splitserve bench serve: every warm-up request failed: {bad[0]}", file=sys.stderr
            )
            return 1
    slos = dict(args.goodput) if args.goodput else None
    runs: list[dict[str, Any]] = []
    all_results = []
    for rate in args.request_rate:
        offsets = load.arrival_offsets(
            len(conversations), rate, args.burstiness, args.arrival == "fixed", args.seed
        )
        bar = tqdm(total=count, disable=args.disable_tqdm, desc=f"rate {rate}", leave=False)
        results, duration, cpu = load.run_load(
            target,
            list(zip(conversations, offsets, strict=True)),
            args.max_concurrency,
            args.num_client_processes,
            functools.partial(bar.update, 1),
        )
        bar.close()
        ok = [r for r in results if r.success]
        run: dict[str, Any] = {
            "date": time.strftime("%Y%m%d-%H%M%S"),
            "backend": args.backend,
            "model_id": model,
            "dataset_name": args.dataset_name,
            "num_prompts": count,
            "request_rate": rate,
            "arrival": args.arrival,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency or None,
            "num_client_processes": args.num_client_processes,
            **metrics.compute(
                results, duration, args.percentile_metrics, args.metric_percentiles, slos
            ),
            "goodput_slos_ms": slos,
            "client_cpu": cpu,
            "input_lens": [r.input_tokens for r in ok],
            "output_lens": [r.output_tokens for r in ok],
            "ttfts": [r.ttft for r in ok],
            "itls": [r.itl for r in ok],
            "errors": [r.error for r in results if not r.success],
        }
        runs.append(run)
        all_results.append(results)
        print(report.table(run, args.percentile_metrics, args.metric_percentiles), flush=True)
        if run["errors"]:
            print(f"first error: {run['errors'][0]}", file=sys.stderr)
        if warning := load.cpu_warning(cpu):
            print(warning, file=sys.stderr)
    if args.save_result:
        name = args.result_filename or time.strftime(
            f"splitserve-bench-{args.backend}-%Y%m%d-%H%M%S.json"
        )
        report.save(runs, name)
        print(f"wrote {name}")
    if args.plot_dir:
        try:
            for path in report.plot(runs, all_results, args.plot_dir):
                print(f"wrote {path}")
        except ImportError:
            print(
                "splitserve bench serve: plots need matplotlib, which is not installed: "
                "pip install 'splitserve[bench]' (the figures above are complete)",
                file=sys.stderr,
            )
    return 0 if all(run["completed"] for run in runs) else 1
