"""Prefix reuse through a real stack: how much of the prompts that agents and chats resend comes
from cache, and what it saves in TTFT.

    python -m bench.prefix_reuse --smoke                        # CPU, tiny model, small load
    python -m bench.prefix_reuse --device cpu                   # CPU, tiny model, the full load
    python -m bench.prefix_reuse --device cuda:0                # one GPU, every worker on it

Two sections, each on a stack of its own (`splitserve.launch.up`: redis-server, workers, gateway,
each its own process):

- `shared`: `--groups` groups of `--per-group` prompts; a group's prompts share a `--system`-token
  system prompt, then a `--question`-token question of their own; `--output` tokens each. The
  prompts are shuffled and sent `--concurrency` at a time to `--config` (two workers by
  default). Reported: the share of system-prompt tokens served from cache (each request's
  `cached_prompt_tokens`, up to its system prompt's whole blocks) against the ideal
  (per-group - 1) / per-group (a group's first prompt can find nothing), and how many requests
  each worker took.
- `turns`: P/D (one prefill and one decode worker) conversations of `--turns` turns: each turn's
  prompt is the history (every earlier prompt and reply) and a `--question`-token message. Each
  later turn is paired with a first turn of the same length (fresh tokens: nothing cached),
  sent right after it; reported: their TTFTs (median over conversations) and the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.common import model_dir, table, write_results
from splitserve.client import stream
from splitserve.engine import SamplingParams
from splitserve.kv_transfer.cluster import secret_metadata
from splitserve.kv_transfer.registry import Registry
from splitserve.launch.up import Stack, StackSettings, start_stack
from splitserve.protos.v1 import gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

CONFIGS = {
    # name: (prefill workers, decode workers); on a GPU every worker shares cuda:0
    "2 colocated": (0, 2),
    "1P+2D": (1, 2),
}


@dataclass
class Reply:
    ttft_s: float
    cached: int
    token_ids: list[int]


def _ask(stub: Any, prompt: list[int], output: int, timeout_s: float) -> Reply:
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    sent = time.monotonic()
    first, cached, tokens = 0.0, 0, []
    for msg in stream(stub, prompt, params, timeout_s=timeout_s):
        if msg.HasField("chunk"):
            first = first or time.monotonic()
            tokens.extend(msg.chunk.token_ids)
        if msg.HasField("finished"):
            cached = msg.finished.usage.cached_prompt_tokens
    return Reply(first - sent, cached, tokens)


def _stack(args: argparse.Namespace, model: Path, prefill: int, decode: int) -> Stack:
    worker_args = ["--max-num-seqs", str(args.max_num_seqs),
                   "--max-model-len", str(args.max_model_len), *args.worker_args]  # fmt: skip
    if args.device == "cpu":
        worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    else:
        worker_args += ["--load-format", "dummy", "--kv-cache-memory-bytes", str(args.kv_bytes)]
    devices = () if args.device == "cpu" else (args.device,) * (prefill + decode)
    return start_stack(
        StackSettings(
            model=str(model),
            prefill=prefill,
            decode=decode,
            devices=devices,
            extra_worker_args=tuple(worker_args),
            startup_timeout_s=900.0,
        )  # fmt: skip
    )


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _stub(stack: Stack) -> Any:
    channel = grpc.insecure_channel(
        stack.address, options=[("grpc.max_receive_message_length", 16 << 20)]
    )
    return gateway_pb2_grpc.GatewayStub(channel)


def _worker_stats(stack: Stack) -> dict[str, Any]:
    """Each serving (decode or colocated) worker's stats, asked as a member of the stack."""
    secret = stack.secrets.cluster_secret if stack.secrets is not None else ""
    registry = Registry(stack.redis_url)
    try:
        live = [w for kind in ("decode", "colocated") for w in registry.live_workers(kind)]
    finally:
        registry.close()
    found = {}
    for w in live:
        with grpc.insecure_channel(w.address) as channel:
            found[w.worker_id] = worker_pb2_grpc.DecodeWorkerStub(channel).GetStats(
                worker_pb2.GetStatsRequest(), timeout=10, metadata=secret_metadata(secret)
            )
    return found


def shared(args: argparse.Namespace, model: Path, vocab: int) -> dict[str, Any]:
    rng = random.Random(7)
    systems = [_tokens(rng, args.system, vocab) for _ in range(args.groups)]
    prompts = [
        systems[g] + _tokens(rng, args.question, vocab)
        for g in range(args.groups)
        for _ in range(args.per_group)
    ]
    rng.shuffle(prompts)
    prefill, decode = CONFIGS[args.config]
    stack = _stack(args, model, prefill, decode)
    try:
        stub = _stub(stack)
        start = time.monotonic()
        done = [0]

        def one(prompt: list[int]) -> Reply:
            reply = _ask(stub, prompt, args.output, args.timeout_s)
            done[0] += 1
            if done[0] % max(1, len(prompts) // 10) == 0:
                print(f"  {done[0]}/{len(prompts)} requests, {time.monotonic() - start:.0f} s")
            return reply

        with ThreadPoolExecutor(args.concurrency) as pool:
            replies = list(pool.map(one, prompts))
        elapsed = time.monotonic() - start
        found = _worker_stats(stack)
    finally:
        stack.stop()
    system_blocks = args.system // args.block_size * args.block_size  # only whole blocks cache
    from_cache = sum(min(r.cached, system_blocks) for r in replies)
    share = from_cache / (len(replies) * args.system)
    ideal = (args.per_group - 1) / args.per_group * system_blocks / args.system
    return {
        "config": args.config,
        "requests": len(replies),
        "system-prompt tokens from cache": round(share, 4),
        "ideal": round(ideal, 4),
        "tokens computed by worker": {w: s.num_prefill_tokens for w, s in found.items()},
        "ttft p50 s": round(statistics.median(r.ttft_s for r in replies), 4),
        "seconds": round(elapsed, 1),
        "short replies": sum(len(r.token_ids) != args.output for r in replies),
    }


def turns(args: argparse.Namespace, model: Path, vocab: int) -> dict[str, Any]:
    rng = random.Random(11)
    stack = _stack(args, model, 1, 1)
    later: list[float] = []
    fresh: list[float] = []
    rows = []
    try:
        stub = _stub(stack)
        _ask(stub, _tokens(rng, args.question, vocab), 4, args.timeout_s)  # NOTE: warm-up
        for conv in range(args.conversations):
            history = _tokens(rng, args.system, vocab)
            for turn in range(args.turns):
                prompt = history + _tokens(rng, args.question, vocab)
                reply = _ask(stub, prompt, args.output, args.timeout_s)
                if turn:
                    first = _ask(
                        stub, _tokens(rng, len(prompt), vocab), args.output, args.timeout_s
                    )
                    later.append(reply.ttft_s)
                    fresh.append(first.ttft_s)
                    rows.append({"conversation": conv, "turn": turn + 1, "prompt": len(prompt),
                                 "cached": reply.cached, "later ttft ms": 1e3 * reply.ttft_s,
                                 "first-turn ttft ms": 1e3 * first.ttft_s})  # fmt: skip
                history = prompt + reply.token_ids
    finally:
        stack.stop()
    return {
        "rows": rows,
        "later-turn ttft p50 ms": round(1e3 * statistics.median(later), 2),
        "first-turn ttft p50 ms": round(1e3 * statistics.median(fresh), 2),
        "ratio": round(statistics.median(later) / statistics.median(fresh), 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["shared", "turns"],
                        choices=["shared", "turns"])  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu (tiny random model) or cuda:N")
    parser.add_argument("--shape", default="llama-3.2-1b", help="on a GPU: dummy weights")
    parser.add_argument("--config", default="2 colocated", choices=sorted(CONFIGS))
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system", type=int, default=4096, help="system-prompt tokens")
    parser.add_argument("--question", type=int, default=128, help="question / message tokens")
    parser.add_argument("--output", type=int, default=256, help="tokens generated per request")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--num-kv-blocks", type=int, default=40000, help="per worker, on the CPU")
    parser.add_argument("--kv-bytes", type=int, default=20 << 30,
                        help="on a GPU: each worker's KV cache (they share the GPU)")  # fmt: skip
    parser.add_argument("--worker-args", nargs="*", default=[], help="more flags for every worker")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, small load")
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix_reuse.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.groups, args.per_group, args.system = "cpu", 4, 4, 256
        args.question, args.output, args.concurrency = 16, 8, 8
        args.conversations, args.turns, args.num_kv_blocks = 2, 3, 2048
    result: dict[str, Any] = {"benchmark": "prefix_reuse", "date": time.strftime("%Y-%m-%d"),
                              "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if args.device == "cpu":
            from splitserve.testing.tiny_model import make_tiny_model

            long = {"max_position_embeddings": args.max_model_len}
            model = make_tiny_model(Path(tmp) / "tiny", "llama", config_overrides=long)
            vocab = 500
            result["shape"] = "tiny llama (random weights, float32, CPU)"
        else:
            model, vocab = model_dir(args.shape, Path(tmp)), 32000
            result["shape"] = f"{args.shape} (dummy weights, bf16, {args.device})"
        if "shared" in args.sections:
            result["shared"] = s = shared(args, model, vocab)
            print(table([{k: v for k, v in s.items() if k != "tokens computed by worker"}],
                        [k for k in s if k != "tokens computed by worker"]))  # fmt: skip
            print("tokens computed by worker:", s["tokens computed by worker"])
        if "turns" in args.sections:
            result["turns"] = t = turns(args, model, vocab)
            print(table(t["rows"], list(t["rows"][0])))
            print({k: v for k, v in t.items() if k != "rows"})
    write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
