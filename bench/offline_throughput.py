"""DESIGN.md benchmark 1: offline throughput, nano-vllm protocol, against HF static batching.

    python -m bench.offline_throughput --shape qwen3-0.6b [--num-requests 256] [--out F]

256 requests with input and output lengths uniform in [100, 1024], random token ids, EOS
ignored; output tokens/s of `LLM.generate`. Baseline in the same run: HF `transformers`
`generate` in static batches of 32 in arrival order (left padding, each batch runs to its
longest output) on the same shape and dtype; `--baseline-batches K` times only the first K
batches (stated in the results) because a full baseline of a large shape takes many minutes.
Also a fixed-length grid (in/out 128/128, 1024/128, 128/1024) as output and total tokens/s.
`--gpu-busy` runs each configuration once more under the profiler (GPU activity only) and
reports the share of that run's wall time the GPU spent in kernels, by kind (what is left is
the GPU waiting on the host: scheduling, sampling, outputs between steps), and the kernels that
took the most GPU time.
"""

from __future__ import annotations

import argparse
import functools
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import SHAPES, device_name, model_dir, sync, table, write_results


def workload(num: int, seed: int, lo: int = 100, hi: int = 1024, vocab: int = 10000):
    rng = random.Random(seed)
    lens = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(num)]
    prompts = [[rng.randrange(10, vocab) for _ in range(n_in)] for n_in, _ in lens]
    return prompts, [n_out for _, n_out in lens]


KERNEL_KINDS = (  # (kind, name fragments), first match wins
    ("attention", ("decode_split", "decode_merge", "prefill_attention")),
    ("matmul", ("gemv", "gemm", "cutlass", "nvjet", "sm90_", "scaled_mm", "skinny")),
)
TOP_KERNELS = 12  # the kernels `--gpu-busy` lists by their GPU seconds


def gpu_busy(llm, prompts, params) -> dict[str, float]:
    """Share of a profiled run's wall time the GPU spent in kernels: in all, and by kind."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    busy = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    kernels = {}
    for event in prof.key_averages():
        kind = next((k for k, parts in KERNEL_KINDS if any(p in event.key for p in parts)), "other")
        busy[kind] += event.self_device_time_total
        kernels[event.key[:60]] = event.self_device_time_total / 1e6
    shares = {f"GPU {kind}": us / wall_us for kind, us in busy.items()}
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS])
    return {
        "GPU busy": sum(busy.values()) / wall_us,
        **shares,
        "profiled_s": wall_us / 1e6,
        "top kernels s": top,
    }


def run_engine(
    path: Path,
    prompts,
    outputs,
    dtype: str,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    profile_busy: bool = False,
    async_scheduling: bool | None = None,
) -> dict[str, Any]:
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(
        path,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        load_format="dummy",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        async_scheduling=async_scheduling,
    )
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts[:4], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), "every request must produce its full output"
    busy = gpu_busy(llm, prompts, params) if profile_busy else {}
    del llm
    torch.cuda.empty_cache()
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "prompt_tokens": sum(map(len, prompts)),
        "num_requests": len(prompts),
        **busy,
    }


def run_hf(shape: str, prompts, outputs, dtype: torch.dtype, batches: int | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        **{k: v for k, v in SHAPES[shape].items() if k not in ("architectures",)}
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    pad = 0
    total = useful = 0
    seconds = 0.0
    groups = [range(i, min(i + 32, len(prompts))) for i in range(0, len(prompts), 32)]
    for group in groups[: batches or len(groups)]:
        batch = [prompts[i] for i in group]
        longest_in = max(map(len, batch))
        ids = torch.tensor([[pad] * (longest_in - len(p)) + p for p in batch], device="cuda")
        mask = (
            torch.arange(longest_in, device="cuda")[None, :]
            >= torch.tensor([longest_in - len(p) for p in batch], device="cuda")[:, None]
        )
        longest_out = max(outputs[i] for i in group)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                max_new_tokens=longest_out,
                min_new_tokens=longest_out,
                do_sample=False,
                pad_token_id=pad,
            )
        sync()
        seconds += time.perf_counter() - start
        useful += sum(outputs[i] for i in group)
        total += len(batch) * longest_out
    del model
    torch.cuda.empty_cache()
    return {
        "seconds": seconds,
        "output_tokens": useful,
        "generated_incl_padding": total,
        "batches_timed": min(batches or len(groups), len(groups)),
        "batches_total": len(groups),
    }


def _rate(result: dict[str, Any]) -> float:
    return result["output_tokens"] / result["seconds"]


def _row(system: str, result: dict[str, Any]) -> dict[str, Any]:
    shares = {k: v for k, v in result.items() if k.startswith("GPU ")}
    return {
        "system": system,
        "requests": result["num_requests"],
        "out tok/s": _rate(result),
        "seconds": result["seconds"],
        **shares,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--baseline-batches", type=int, default=0, help="0: all")
    parser.add_argument("--grid", action="store_true", help="also the fixed-length grid")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/offline_throughput.json")
    parser.add_argument(
        "--quantization", choices=["none", "fp8"], default="none", help="fp8: also FP8 weights"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8 (with --quantization fp8): also FP8 weights with an FP8 KV cache",
    )
    parser.add_argument("--skip-hf", action="store_true", help="no HF baseline (FP8 A/B only)")
    parser.add_argument(
        "--gpu-busy", action="store_true", help="also the GPU's busy share (a profiled rerun)"
    )
    parser.add_argument(
        "--async-scheduling",
        choices=["on", "off"],
        default="on",
        help="overlapped decode steps (engine/overlap.py), the engine's default on a GPU",
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    dtype = torch.bfloat16
    run = functools.partial(run_engine, async_scheduling=args.async_scheduling == "on")
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.shape, Path(tmp))
        prompts, outputs = workload(args.num_requests, args.seed)
        busy = args.gpu_busy
        ours = run(path, prompts, outputs, "bfloat16", profile_busy=busy)
        rows = [_row("splitserve LLM", ours)]
        fp8 = fp8_kv = None
        if args.quantization == "fp8":
            fp8 = run(path, prompts, outputs, "bfloat16", "fp8", profile_busy=busy)
            rows.append(_row("splitserve LLM, FP8 weights", fp8))
            if args.kv_cache_dtype == "fp8":
                fp8_kv = run(path, prompts, outputs, "bfloat16", "fp8", "fp8", profile_busy=busy)
                rows.append(_row("splitserve LLM, FP8 weights + KV", fp8_kv))
        hf = None
        if not args.skip_hf:
            hf = run_hf(args.shape, prompts, outputs, dtype, args.baseline_batches or None)
            rows.append(
                {
                    "system": "HF static batch 32",
                    "requests": 32 * hf["batches_timed"],
                    "out tok/s": hf["output_tokens"] / hf["seconds"],
                    "seconds": hf["seconds"],
                }
            )
        speedup = rows[0]["out tok/s"] / rows[-1]["out tok/s"] if hf else None
        grid = []
        if args.grid:
            for n_in, n_out in ((128, 128), (1024, 128), (128, 1024)):
                g_prompts, _ = workload(args.num_requests, args.seed + 1, n_in, n_in)
                res = run(path, g_prompts, [n_out] * len(g_prompts), "bfloat16")
                grid.append(
                    {
                        "in/out": f"{n_in}/{n_out}",
                        "out tok/s": res["output_tokens"] / res["seconds"],
                        "total tok/s": (res["output_tokens"] + res["prompt_tokens"])
                        / res["seconds"],
                    }
                )
    results = {
        "benchmark": "offline_throughput",
        "device": device_name(),
        "shape": args.shape,
        "config": SHAPES[args.shape],
        "dtype": "bfloat16",
        "ignore_eos": True,
        "async_scheduling": args.async_scheduling,
        "workload": f"{args.num_requests} requests, in/out uniform 100-1024, seed {args.seed}",
        "splitserve": ours,
        "splitserve_fp8": fp8,
        "fp8_speedup": fp8 and _rate(fp8) / rows[0]["out tok/s"],
        "splitserve_fp8_kv": fp8_kv,
        "fp8_kv_speedup": fp8_kv and _rate(fp8_kv) / rows[0]["out tok/s"],
        "hf_baseline": hf,
        "speedup": speedup,
        "grid": grid,
    }
    write_results(args.out, results)
    print(
        f"device: {device_name()}  shape: {args.shape}  dtype: bf16  EOS ignored  "
        f"async scheduling {args.async_scheduling}"
    )
    print(table(rows, list(rows[0])))
    if speedup is not None:
        print(f"speedup over HF static batching: {speedup:.1f}x")
    if fp8 is not None:
        print(f"FP8 weights against bf16: {results['fp8_speedup']:.2f}x")
    if fp8_kv is not None:
        print(f"FP8 weights and KV cache against bf16: {results['fp8_kv_speedup']:.2f}x")
    if grid:
        print(table(grid, ["in/out", "out tok/s", "total tok/s"]))
    for name, res in (("bf16", ours), ("FP8 weights", fp8), ("FP8 weights + KV", fp8_kv)):
        if res and "top kernels s" in res:
            top = [{"kernel": k, "GPU s": s} for k, s in res["top kernels s"].items()]
            print(f"{name}: the kernels that took the most GPU time in the profiled run")
            print(table(top, ["kernel", "GPU s"]))


if __name__ == "__main__":
    main()
