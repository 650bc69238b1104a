"""DESIGN.md benchmark 2: decode step time against its memory floor.

    python -m bench.decode_roofline [--shape llama-3-8b] [--context 1024] [--out F]
        [--quantization none|fp8|both] [--pdl on|off|both]

For batch 1 and 8 (Llama-3-8B shape, bf16, random weights), the median wall time of a whole
engine step while every sequence decodes, against (weights read + KV read) / the copy bandwidth
measured in the same run. Weights read per step: every parameter except the embedding table
(a decode step reads only B of its rows) and, in a Mixture-of-Experts shape (qwen3-30b-a3b),
the experts no token of the batch picked (recorded in one more step), in the bytes they are
stored in: FP8 weights
(`--quantization fp8`, engine/quantization.py) count one byte each, so their floor is their own.
By default each batch runs twice, with the kernels' programmatic dependent launch off and on
(kernels/pdl.py), each on a freshly captured engine; `--quantization both` runs bf16 and FP8
side by side in the same run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    SHAPES,
    check_whole_batch,
    decode_room,
    device_name,
    model_dir,
    sync,
    table,
    write_results,
)
from bench.kernels import copy_bandwidth


def untouched_expert_bytes(engine) -> int:
    """Bytes of the experts one decode step of the running batch leaves unread (0 in a model
    without Mixture-of-Experts layers): the step is run once more eagerly with every layer's
    routing recorded, and each layer's experts that no token picked are counted. (Random
    weights do not route uniformly, so the expected E * (1 - (1 - k/E)^B) would misstate it.)"""
    layers = [layer.mlp for layer in engine.model.model.layers if hasattr(layer.mlp, "experts")]
    if not layers:
        return 0
    from splitserve.engine import deepseek_moe

    picked: list[torch.Tensor] = []
    ops = layers[0].ops  # NOTE: one ops object serves every layer
    route, route_deepseek = ops.moe_route, deepseek_moe.route

    def recording(route_fn):
        def recorded(*args, **kwargs):
            weights, ids = route_fn(*args, **kwargs)
            picked.append(ids.flatten())
            return weights, ids

        return recorded

    graphs, engine.runner.graphs = engine.runner.graphs, None
    ops.moe_route = recording(route)
    # NOTE: DeepSeek's grouped and sigmoid routers run in torch, not through `ops`
    deepseek_moe.route = recording(route_deepseek)
    try:
        engine.step()
        sync()
    finally:
        del ops.moe_route
        deepseek_moe.route = route_deepseek
        engine.runner.graphs = graphs
    total = 0
    for block, ids in zip(layers, picked[-len(layers) :], strict=True):
        per_expert = sum(p[0].numel() * p.element_size() for p in block.experts.parameters())
        total += per_expert * (block.moe.num_experts - len(set(ids.tolist())))
    return total


def measure_copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device copy (read + write), timed with CUDA events as bench/kernels.py
    times it (a host-clocked copy reads ~2% low, which would make the floor lenient)."""
    return copy_bandwidth(2 << 30, torch.device("cuda"))["GB_per_s"] * 1e9


def back_to_back(engine, steps: int) -> float:
    """Seconds per step over `steps` calls with no sync between them (one at the end)."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return (time.perf_counter() - start) / steps


def _mean_tokens(engine) -> float:
    running = engine.scheduler.running
    return sum(s.num_tokens for s in running) / max(1, len(running))


def decode_step_times(
    engine, batch: int, context: int, steps: int
) -> tuple[list[float], float, int]:
    """Seconds per decode step, and the mean tokens per sequence while they were timed. A
    synchronous engine's steps are each timed between two device syncs. With overlapped steps
    a call returns while its step still runs, so the figure is the steady-state period
    instead: `steps` back-to-back calls (after two that fill the pipeline) and a final sync,
    divided by `steps`.

    NOTE: chunked prefill admits the sequences a chunk at a time and the first ones decode
    while the rest prefill (a large batch takes batch * context / 2048 steps to fill), so
    each may run to the model's length, and the batch is checked whole when timed: a step
    timed after some finished would be a smaller batch's (bench.common.decode_room)."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=decode_room(engine, context), ignore_eos=True)
    span = min(5000, engine.model_config.vocab_size - 10)
    for i in range(batch):
        # NOTE: prompts of their own per batch size: none is a prefix-cache hit
        engine.add_request([10 + (batch * 131 + i + j) % span for j in range(context)], params)
    while (
        any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()  # prefill
    before = _mean_tokens(engine)
    times = []
    if engine.overlap:
        engine.step()
        engine.step()
        times.append(back_to_back(engine, steps))
    for _ in range(0 if engine.overlap else steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
    check_whole_batch(engine, batch)
    mean_tokens = (before + _mean_tokens(engine)) / 2
    unread = untouched_expert_bytes(engine)
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.request_id)
    # NOTE: idle before the next batch is timed: timed right after aborting 128 running
    # sequences (and with their prompts cached), the next 256 took 19.9 ms a step on an H200
    # where they take 14.2 alone
    while engine.has_unfinished_requests():
        engine.step()
    return times, mean_tokens, unread


def profile_steps(engine, batch: int, context: int, steps: int = 10) -> str:
    """Where a decode step's time goes: GPU kernel time against the wall time of the step."""
    from torch.profiler import ProfilerActivity, profile

    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request([10 + (i + j) % 5000 for j in range(context)], params)
    for _ in range(5):
        engine.step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - start) / steps
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.request_id)
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / steps / 1e3
    top = events.table(sort_by="self_device_time_total", row_limit=12)
    return f"batch {batch}: wall {wall * 1e3:.2f} ms/step, GPU kernels {gpu:.2f} ms/step\n{top}"


@torch.inference_mode()
def breakdown(engine, batch: int, context: int, steps: int = 50) -> dict:
    """A decode step split into its graph replay (model + LM head) and the host rest; prints
    the host's profile."""
    import cProfile
    import io
    import pstats

    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=3 * steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request([10 + (i + j) % 5000 for j in range(context)], params)
    for _ in range(5):
        engine.step()
    period = back_to_back(engine, steps)
    host = cProfile.Profile()
    host.runcall(lambda: [engine.step() for _ in range(steps)])
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(18)
    print(f"batch {batch}: host profile of {steps} steps\n{text.getvalue()[-4000:]}")
    graphs = engine.runner.graphs
    bucket = next(b for b in graphs.buckets if b >= batch)
    graph = graphs._graphs[bucket]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        graph.graph.replay()
    end.record()
    sync()
    replay = begin.elapsed_time(end) / 1e3 / steps
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.request_id)
    return {
        "batch": batch,
        "step ms (back to back)": period * 1e3,
        "graph replay ms": replay * 1e3,
        "host rest ms": (period - replay) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine max_model_len (default context + 4 * steps + 64); the decode graphs size "
        "their attention splits for it",
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes to time"
    )
    parser.add_argument("--out", default="bench/results/decode_roofline.json")
    parser.add_argument("--profile", action="store_true", help="also profile batch-1 steps")
    parser.add_argument(
        "--breakdown", action="store_true", help="also split steps into replay / host"
    )
    parser.add_argument(
        "--pdl",
        choices=["on", "off", "both"],
        default="both",
        help="programmatic dependent launch in the kernels (kernels/pdl.py); both = A/B",
    )
    parser.add_argument("--quantization", choices=["none", "fp8", "both"], default="none")
    parser.add_argument(
        "--attention-backends",
        nargs="+",
        choices=["auto", "triton", "torch"],
        default=["auto"],
        help="engines to time, one per backend (torch: eager, no CUDA graphs: a baseline)",
    )
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument(
        "--async-scheduling",
        choices=["on", "off", "both"],
        default="both",
        help="overlapped decode steps (engine/overlap.py); both = A/B",
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import bytes_per_block
    from splitserve.engine.quantization import weight_bytes as stored_bytes

    max_model_len = args.max_model_len or args.context + 4 * args.steps + 64
    if max_model_len < args.context + 4 * args.steps + 64:
        parser.error(f"--max-model-len must be at least {args.context + 4 * args.steps + 64}")
    bandwidth = measure_copy_bandwidth()
    rows = []
    pdl_modes = {"on": [True], "off": [False], "both": [False, True]}[args.pdl]
    quant_modes = {"none": ["none"], "fp8": ["fp8"], "both": ["none", "fp8"]}[args.quantization]
    async_modes = {"on": [True], "off": [False], "both": [False, True]}[args.async_scheduling]
    modes = [
        (q, pdl, a, backend)
        for backend in args.attention_backends
        for q in quant_modes
        for pdl in pdl_modes
        for a in async_modes
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.shape, Path(tmp))
        for quant, pdl, overlap, backend in modes:
            engine = None
            gc.collect()
            torch.cuda.empty_cache()
            engine = LLMEngine(
                path,
                EngineConfig(
                    dtype=torch.bfloat16,
                    device="cuda",
                    load_format="dummy",
                    max_num_seqs=max(args.batches),
                    max_model_len=max_model_len,
                    enable_pdl=pdl,
                    quantization=quant,
                    kv_cache_dtype=args.kv_cache_dtype,
                    async_scheduling=overlap,
                    attention_backend=backend,
                ),
            )
            cfg = engine.model_config
            embedding = engine.model.model.embed_tokens.weight
            all_weight_bytes = stored_bytes(engine.model) - (
                embedding.numel() * embedding.element_size() * (not cfg.tie_word_embeddings)
            )
            # NOTE: per token and every layer: keys and values, or MLA's one latent row
            kv_per_token = bytes_per_block(cfg, 1, engine.kv_cache.pool.dtype)
            for batch in args.batches:
                times, mean_tokens, unread = decode_step_times(
                    engine, batch, args.context, args.steps
                )
                weight_bytes = all_weight_bytes - unread
                kv_bytes = batch * mean_tokens * kv_per_token
                rows.append(
                    {
                        "batch": batch,
                        "weights": "fp8" if quant == "fp8" else "bf16",
                        "PDL": "on" if pdl else "off",
                        "async": "on" if overlap else "off",
                        "attention": engine.platform.attention_backend,
                        "graphs": "on" if engine.platform.cuda_graphs else "off",
                        "step ms": statistics.median(times) * 1e3,
                        "bytes": weight_bytes + kv_bytes,
                        "weights GB": weight_bytes / 1e9,
                        "KV MB": kv_bytes / 1e6,
                        "mean context": round(mean_tokens),
                    }
                )
    # NOTE: the bandwidth is measured before and after; the higher one sets the (lower) floor.
    bandwidth = max(bandwidth, measure_copy_bandwidth())
    for row in rows:
        row["floor ms"] = row.pop("bytes") / bandwidth * 1e3
        row["ratio"] = row["step ms"] / row["floor ms"]
    results = {
        "benchmark": "decode_roofline",
        "device": device_name(),
        "shape": args.shape,
        "dtype": "bfloat16",
        "quantization": quant_modes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "context": args.context,
        "max_model_len": max_model_len,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "rows": rows,
    }
    write_results(args.out, results)
    if args.breakdown:
        parts = [breakdown(engine, batch, args.context) for batch in (1, 8)]
        results["breakdown"] = parts
        write_results(args.out, results)
        print(table(parts, list(parts[0])))
    if args.profile:
        print(profile_steps(engine, 1, args.context))
    print(
        f"device: {device_name()}  shape: {args.shape}  bf16 activations  "
        f"KV cache {args.kv_cache_dtype}  context {args.context}  "
        f"max_model_len {max_model_len}  "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )
    columns = ["weights", "attention", "graphs", "batch", "PDL", "async", "step ms", "floor ms"]
    columns += ["ratio", "weights GB"]
    columns.append("KV MB")
    print(table(rows, columns))
    same = ("attention", "batch", "PDL", "async")
    speedups = [
        {**{k: r8[k] for k in same}, "fp8 speed-up": r16["step ms"] / r8["step ms"]}
        for r16 in rows
        for r8 in rows
        if r16["weights"] == "bf16"
        and r8["weights"] == "fp8"
        and all(r16[k] == r8[k] for k in same)
    ]
    if speedups:
        results["fp8_speedup"] = speedups
        write_results(args.out, results)
        print(table(speedups, [*same, "fp8 speed-up"]))


if __name__ == "__main__":
    main()
