"""The host-memory KV tier (`--kv-host-cache-gb`, engine/host_tier.py) on one GPU, each figure
against the same engine without the tier in the same run (Llama-3-8B's shape, bf16, dummy
weights, token-id prompts):

    hit      a 32k-token prefix evicted from the GPU comes back from host memory: TTFT against
             recomputing it, the host->GPU copy rate, and the TTFT of misses (the tier's cost)
    tpot     a decode batch's step time with the tier on and off (write-through saves)
    swap     a preempted 8k-token sequence whose GPU blocks were all taken: the step that
             resumes it, and the tokens it computes again
    working  a working set twice the GPU cache (shared 2k-token documents): throughput with
             every request queued at once, and p90 TTFT under Poisson arrivals at 1.5x the
             GPU-only throughput

    python -m bench.host_tier                                   # all sections, GPU
    python -m bench.host_tier --sections hit --context 32768
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import SHAPES, device_name, sync, table, write_results

GIB = 1 << 30


def model_dir(root: Path, shape: str, max_len: int) -> Path:
    from splitserve.testing.tiny_model import make_tiny_model

    path = root / shape
    make_tiny_model(path, "llama")
    for weights in path.glob("*.safetensors*"):
        weights.unlink()
    raw = {**SHAPES[shape], "max_position_embeddings": max_len, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def longest(args: argparse.Namespace) -> int:
    """The model length every section fits in."""
    return max(args.context, args.swap_context, args.doc_tokens + 64, args.tpot_prompt) + 256


def kv_gib(shape: str, tokens: int) -> float:
    """GiB of bf16 keys and values `tokens` tokens take in `shape`."""
    raw = SHAPES[shape]
    head_dim = raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    per_token = raw["num_hidden_layers"] * 2 * raw["num_key_value_heads"] * head_dim * 2
    return tokens * per_token / GIB


def engine(path: Path, args: argparse.Namespace, gpu_gib: float, host_gib: float | None, **kw):
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig

    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    config = EngineConfig(
        dtype=torch.bfloat16,
        device=args.device,
        load_format="dummy",
        max_model_len=longest(args),
        max_num_batched_tokens=args.chunk,
        kv_cache_memory_bytes=int(gpu_gib * GIB),
        kv_host_cache_bytes=None if host_gib is None else int(host_gib * GIB),
        **kw,
    )
    return LLMEngine(path, config)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 120000) for _ in range(length)]


def run_one(eng, tokens: list[int], max_tokens: int = 1, **kw) -> tuple[float, list[int]]:
    """Seconds to the first token, and the tokens, of one request run alone."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    rid = eng.add_request(tokens, params, **kw)
    ttft, out = None, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid:
                out = list(o.outputs[0].token_ids)
                if ttft is None and out:
                    sync()
                    ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, out


def section_hit(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Warm up; prefixes A, B, C of `context` tokens (misses); B and C push A out of a GPU
    cache of 1.5 of them; then A with a new question: a host hit, or a recompute."""
    from splitserve.engine.host_index import HostWork

    n = args.context
    gpu = kv_gib(args.shape, 3 * n // 2 + 256)  # B and C each push part of A out
    rows = []
    for host in (None, 3 * gpu):
        eng = engine(path, args, gpu, host)
        run_one(eng, prompt(99, args.chunk))
        misses = [run_one(eng, prompt(seed, n) + [7])[0] for seed in (1, 2, 3)]
        question = prompt(1, n) + prompt(4, 64)
        before = eng.stats()
        ttft, tokens = run_one(eng, question, max_tokens=16)
        after = eng.stats()
        row = {
            "tier": "off" if host is None else f"{host:.1f} GiB",
            "miss TTFT s": statistics.median(misses),
            "32k again TTFT s": ttft,
            "tokens computed": after.num_prefill_tokens - before.num_prefill_tokens,
            "host GiB loaded": (after.host_cache_bytes_loaded - before.host_cache_bytes_loaded)
            / GIB,
            "_tokens": tokens,
        }
        tier = eng.host_tier
        if tier is not None:  # NOTE: last: overwrites the pool
            blocks = min(n // 16, tier.index.num_slots, eng.config.num_kv_blocks)
            pairs = tuple((i, i) for i in range(blocks))
            for name, work in (("load", HostWork(loads=pairs)), ("save", HostWork(saves=pairs))):
                times = []
                for _ in range(3):
                    sync()
                    start = time.perf_counter()
                    tier.run(work)
                    sync()
                    times.append(time.perf_counter() - start)
                row[f"{name} GB/s"] = blocks * eng.kv_cache.block_bytes / min(times) / 1e9
        rows.append(row)
        eng.shutdown()
        del eng
    rows[1]["tokens identical"] = rows[0].pop("_tokens") == rows[1].pop("_tokens")
    return rows


def section_tpot(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A batch of `--batch` sequences (`--tpot-prompt`-token prompts) decoding 256 tokens:
    the mean step while all decode, timed without a sync between steps (overlapped steps stay
    overlapped, so the tier's host work shows only where the GPU would wait for it). Off and
    on twice, alternating."""
    from splitserve.engine import SamplingParams

    rows = []
    batch, length = args.batch, args.tpot_prompt
    gpu = kv_gib(args.shape, batch * (length + 256)) * 1.25
    for host in (None, 2 * gpu, None, 2 * gpu):
        eng = engine(path, args, gpu, host)
        params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
        for i in range(batch):
            eng.add_request(prompt(100 + i, length), params)
        steps, start, end = 0, None, None
        while eng.has_unfinished_requests():
            running = eng.scheduler.running
            timed = (
                len(running) == batch
                and not eng.scheduler.waiting
                and all(s.num_computed_tokens >= s.num_tokens - 1 for s in running)
            )
            if timed and start is None:
                sync()
                start = time.perf_counter()
            elif not timed and start is not None and end is None:
                sync()
                end = time.perf_counter()
            eng.step()
            steps += timed
        sync()
        end = end or time.perf_counter()
        assert start is not None
        rows.append({"tier": "off" if host is None else f"{host:.1f} GiB", "batch": batch,
                     "steps": steps, "TPOT ms": (end - start) / steps * 1e3,
                     "saved GiB": eng.stats().host_cache_bytes_saved / GIB})  # fmt: skip
        eng.shutdown()
        del eng
    return rows


def section_swap(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """V (8k tokens, lower priority) and W decode until the pool is full: V is preempted; X
    (8k tokens) then takes V's blocks. When W ends, V resumes: the step that resumes it."""
    from splitserve.engine import SamplingParams

    rows = []
    n, bs = args.swap_context, 16
    gpu = kv_gib(args.shape, (2 * n // bs + 8) * bs) + 1e-6
    for host in (None, 2 * gpu):
        eng = engine(path, args, gpu, host, scheduling_policy="priority")
        run_one(eng, prompt(99, bs * 4))
        long = SamplingParams(temperature=0, max_tokens=192, ignore_eos=True)
        v = eng.add_request(prompt(11, n), long, priority=1)
        eng.add_request(prompt(12, n), long, priority=0)
        while eng.scheduler.num_preemptions == 0:
            eng.step()
        eng.add_request(prompt(13, n), SamplingParams(temperature=0, max_tokens=1), priority=0)
        resume_s, computed = None, None
        while eng.has_unfinished_requests():
            waiting = any(s.request_id == v for s in eng.scheduler.waiting)
            before = eng.stats().num_prefill_tokens
            sync()
            start = time.perf_counter()
            eng.step()
            sync()
            if (
                waiting
                and resume_s is None
                and any(s.request_id == v for s in eng.scheduler.running)
            ):
                resume_s = time.perf_counter() - start
                computed = eng.stats().num_prefill_tokens - before
        rows.append({"tier": "off" if host is None else f"{host:.1f} GiB",
                     "context": n, "preemptions": eng.scheduler.num_preemptions,
                     "resume step ms": (resume_s or 0) * 1e3,
                     "tokens computed": computed})  # fmt: skip
        eng.shutdown()
        del eng
    return rows


def _serve(eng, requests: list[tuple[float, list[int]]], output: int) -> dict[str, float]:
    """Run `requests` (arrival offset s, prompt) as they arrive; TTFT p50/p90 and throughput."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    start, pending, arrived, first = time.perf_counter(), list(requests), {}, {}
    while pending or eng.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, tokens = pending.pop(0)
            arrived[eng.add_request(tokens, params)] = at
        if not eng.has_unfinished_requests():
            time.sleep(min(0.001, max(0.0, pending[0][0] - now)))
            continue
        for o in eng.step():
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    ttft = sorted(first[r] - arrived[r] for r in arrived)
    return {
        "requests": len(ttft),
        "p50 TTFT s": ttft[len(ttft) // 2],
        "p90 TTFT s": ttft[int(len(ttft) * 0.9)],
        "req/s": len(ttft) / elapsed,
    }


def section_working(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """64 documents of 2k tokens (twice the GPU cache's KV) that requests pick uniformly, each
    adding a 64-token question, 32 tokens out: all queued at once (throughput), then Poisson
    arrivals at `--loads` times the GPU-only throughput."""
    doc_len = args.doc_tokens
    docs = [prompt(1000 + d, doc_len) for d in range(64)]
    gpu = kv_gib(args.shape, 64 * doc_len) / 2

    def requests(count: int, rate: float | None, seed: int) -> list[tuple[float, list[int]]]:
        rng, at, out = random.Random(seed), 0.0, []
        for i in range(count):
            at += 0.0 if rate is None else rng.expovariate(rate)
            out.append((at, docs[rng.randrange(len(docs))] + prompt(5000 + i, 64)))
        return out

    rows, saturated = [], 0.0
    for host in (None, 3 * gpu):
        name = "off" if host is None else f"{host:.1f} GiB"
        eng = engine(path, args, gpu, host)
        _serve(eng, requests(16, None, 1), 32)  # warm-up
        sat = _serve(eng, requests(args.requests, None, 2), 32)
        saturated = saturated or sat["req/s"]
        rows.append({"tier": name, "GPU GiB": gpu, "load": "all at once", **sat})
        for load in args.loads:
            rate = load * saturated
            got = _serve(eng, requests(int(rate * args.seconds), rate, 3), 32)
            rows.append({"tier": name, "GPU GiB": gpu, "load": f"{load}x", **got})
        eng.shutdown()
        del eng
    return rows


SECTIONS = {"hit": section_hit, "tpot": section_tpot, "swap": section_swap,
            "working": section_working}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="llama-3-8b", choices=list(SHAPES))
    parser.add_argument("--context", type=int, default=32768, help="the hit section's prefix")
    parser.add_argument("--swap-context", type=int, default=8192, help="the swap section's")
    parser.add_argument("--batch", type=int, default=64, help="the tpot section's")
    parser.add_argument("--tpot-prompt", type=int, default=1024, help="the tpot section's")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="the working section's")
    parser.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=[1.5, 2.7],
        help="arrival rates, as multiples of the GPU-only throughput",
    )
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--requests", type=int, default=256, help="saturated working-set run")
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals under load")
    parser.add_argument("--out", default="bench/results/host_tier.json")
    args = parser.parse_args()
    results: dict[str, Any] = {"device": device_name(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp), args.shape, longest(args))
        for name in args.sections:
            rows = SECTIONS[name](path, args)
            results[name] = rows
            print(f"\n{name}\n{table(rows, list(dict.fromkeys(k for r in rows for k in r)))}",
                  flush=True)  # fmt: skip
            write_results(args.out, results)
    hit = results.get("hit")
    if hit:
        again, miss = (hit[1][k] / hit[0][k] for k in ("32k again TTFT s", "miss TTFT s"))
        print(f"\nhost hit / recompute TTFT: {again:.3f}   miss TTFT on / off: {miss:.3f}")
    tpot = results.get("tpot")
    if tpot:
        off = statistics.mean(r["TPOT ms"] for r in tpot if r["tier"] == "off")
        on = statistics.mean(r["TPOT ms"] for r in tpot if r["tier"] != "off")
        print(f"TPOT on / off: {on / off:.3f}")


if __name__ == "__main__":
    main()
