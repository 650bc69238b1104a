"""Tensor parallelism: TP=N against TP=1 in the same run, and a model too big for one GPU served.

    python -m bench.tensor_parallel [--tp 2] [--shape llama-3-8b] [--prompt-lens 4096 16384]
        [--batches 1 64] [--context 512] [--out F]
    python -m bench.tensor_parallel --serve [--prefill-tp 2] [--decode-tp 2] [--layers N]
    python -m bench.tensor_parallel --smoke          # tiny shape, CPU (gloo) or GPU

Engine mode (the default), for each configuration (TP=1 with its CUDA graphs, TP=1 eager,
TP=N; dummy bf16 weights of the shape, prefix caching off, no overlapped steps, EOS ignored):
  - prefill: TTFT of one prompt of each length (one engine step: max_num_batched_tokens is the
    longest prompt), median over `--reps` fresh random prompts;
  - decode: median engine-step time while `batch` sequences of `--context` tokens decode;
  - the floor of a decode step: this rank's weight bytes (all but the embedding) + KV bytes
    over the copy bandwidth measured in the same run, plus the all-reduces of the step;
  - collectives, measured in the same run in a group of N processes: NCCL's all-reduce bus
    bandwidth on 256 MiB (bytes x 2(N-1)/N / time, as nccl-tests reports it) and the time of
    the all-reduces one step issues (2 per layer + the embedding's, [tokens, hidden] each).

Serve mode: a Llama-3-8B-width stack deep enough (`--layers`, default sized from the GPU's
memory) that its bf16 weights don't fit one GPU, served through the gateway by a prefill
worker at `--prefill-tp` and a decode worker at `--decode-tp` (dummy weights, gRPC KV
transport); reports TTFT and tokens of a few requests. P and D each hold the model, so this
needs prefill_tp + decode_tp GPUs (`--prefill 0` serves a colocated worker at `--decode-tp`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import SHAPES, device_name, model_dir, sync, table, write_results
from bench.tensor_parallel_collectives import measure_collectives

SMOKE_SHAPE = "tiny"
BIG_ALL_REDUCE_BYTES = 256 << 20


def _tiny_dir(root: Path) -> Path:
    from splitserve.testing.tiny_model import make_tiny_model

    return make_tiny_model(root / SMOKE_SHAPE, "llama")


# -- engine --------------------------------------------------------------------------------


def _progress(text: str) -> None:
    """A line as each phase ends: a run cut short by a time limit still shows what it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _random_prompt(length: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(10, vocab, (length,), generator=gen).tolist()


def ttft(engine, length: int, reps: int) -> float:
    """Median seconds from add_request to the first token of a fresh `length`-token prompt."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(length)
    vocab = engine.model_config.vocab_size
    engine.add_request(_random_prompt(min(length, 64), vocab, gen), params)  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    times = []
    for _ in range(reps):
        prompt = _random_prompt(length, vocab, gen)
        sync()
        start = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step(engine, batch: int, context: int, steps: int) -> float:
    """Median seconds of an engine step while `batch` sequences of `context` tokens decode."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(_random_prompt(context, engine.model_config.vocab_size, gen), params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(2):
        engine.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.request_id)
    engine.housekeeping()
    return statistics.median(times)


def rank_weight_bytes(engine) -> int:
    """Bytes of rank 0's parameters a decode step reads (all but the embedding table)."""
    return sum(
        p.numel() * p.element_size()
        for name, p in engine.model.named_parameters()
        if "embed_tokens" not in name
    )


def run_engine_config(
    path: Path, name: str, tp: int, graphs: bool, args, on_gpu: bool, tp_graphs: bool = False
) -> dict:
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig

    longest = max(args.prompt_lens)
    config = EngineConfig(
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        device="cuda:0" if on_gpu else "cpu",
        load_format="dummy",
        tensor_parallel_size=tp,
        enable_cuda_graphs=graphs,
        tensor_parallel_cuda_graphs=tp_graphs,
        # NOTE: TP > 1 can't overlap steps (engine/overlap.py), so no configuration does: the
        # rows differ in degree and graphs only.
        async_scheduling=False,
        enable_prefix_caching=False,
        max_model_len=max(longest, args.context + args.steps + 16) + 16,
        max_num_batched_tokens=max(longest, max(args.batches)),
        max_num_seqs=max(args.batches),
        num_kv_blocks=args.num_kv_blocks,
    )
    start = time.perf_counter()
    engine = LLMEngine(path, config)
    _progress(f"{name}: engine up in {time.perf_counter() - start:.1f} s")
    try:
        row: dict[str, Any] = {
            "config": name,
            "tp": tp,
            "cuda_graphs": engine.runner.graphs is not None,
        }
        for length in args.prompt_lens:
            row[f"ttft_{length}_ms"] = ttft(engine, length, args.reps) * 1e3
            _progress(f"{name}: TTFT {length}: {row[f'ttft_{length}_ms']:.2f} ms")
        for batch in args.batches:
            row[f"step_b{batch}_ms"] = decode_step(engine, batch, args.context, args.steps) * 1e3
            _progress(f"{name}: step at batch {batch}: {row[f'step_b{batch}_ms']:.3f} ms")
        local = engine.model.cfg
        row["weight_bytes_rank0"] = rank_weight_bytes(engine)
        elem = engine.kv_cache.pool.element_size()
        row["kv_bytes_per_token_rank0"] = (
            2 * local.num_layers * local.num_kv_heads * (local.head_dim * elem)
        )
        return row
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # NOTE: the next configuration needs this one's GPU memory back
        if on_gpu:
            torch.cuda.empty_cache()


def engine_mode(args) -> dict:
    on_gpu = torch.cuda.is_available() and not args.cpu
    if on_gpu:
        assert torch.cuda.device_count() >= args.tp, f"--tp {args.tp} needs {args.tp} GPUs"
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_dir(Path(tmp)) if args.smoke else model_dir(args.shape, Path(tmp))
        cfg = json.loads((path / "config.json").read_text())
        # NOTE: a 16k prompt outgrows the Llama-3-8B shape's 8192 positions; the rotary tables
        # extend to any length, and the timing does not depend on their values.
        need = max(*args.prompt_lens, args.context + args.steps) + 64
        if cfg["max_position_embeddings"] < need:
            cfg["max_position_embeddings"] = need
            (path / "config.json").write_text(json.dumps(cfg))
        hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        _progress(f"collectives: all-reduce in a group of {args.tp}")
        collectives = measure_collectives(
            args.tp,
            "cuda" if on_gpu else "cpu",
            hidden,
            layers,
            sorted({*args.prompt_lens, *args.batches}),
            args.big_bytes,
            args.reps_collective,
        )
        bandwidth = None
        if on_gpu:
            from bench.kernels import copy_bandwidth

            bandwidth = copy_bandwidth(2 << 30, torch.device("cuda"))["GB_per_s"] * 1e9
        _progress(f"collectives: {json.dumps(collectives)}; copy {bandwidth} B/s")
        configs = [("TP=1", 1, True, False)]  # the baseline: always first
        if on_gpu and "tp1-eager" in args.configs:
            configs.append(("TP=1 eager", 1, False, False))
        if "tpN" in args.configs:
            configs.append((f"TP={args.tp}", args.tp, True, False))
        if on_gpu and "tpN-graphs" in args.configs:  # opt-in (tensor_parallel_cuda_graphs)
            configs.append((f"TP={args.tp} graphs", args.tp, True, True))
        rows = []
        for name, tp, graphs, tp_graphs in configs:
            _progress(f"{name}: starting")
            try:
                rows.append(run_engine_config(path, name, tp, graphs, args, on_gpu, tp_graphs))
            except Exception as exc:  # noqa: BLE001 - a failed configuration is a result too
                if tp == 1:
                    raise
                rows.append({"config": name, "tp": tp, "error": repr(exc)[:500]})
            _progress(f"{name}: {json.dumps(rows[-1])}")
    measured = [row for row in rows if "error" not in row]
    base = rows[0]
    tp_row = next(r for r in reversed(measured) if r["tp"] > 1) if len(measured) > 1 else base
    for row in measured:
        for length in args.prompt_lens:
            key = f"ttft_{length}_ms"
            row[f"ttft_{length}_speedup"] = base[key] / row[key]
        for batch in args.batches:
            key = f"step_b{batch}_ms"
            row[f"step_b{batch}_speedup"] = base[key] / row[key]
            if bandwidth is not None:
                read = (
                    row["weight_bytes_rank0"]
                    + batch * args.context * row["kv_bytes_per_token_rank0"]
                )
                floor = read / bandwidth
                if row["tp"] > 1:
                    floor += collectives["step"][str(batch)]["per_step_ms"] / 1e3
                row[f"step_b{batch}_floor_ms"] = floor * 1e3
                row[f"step_b{batch}_vs_floor"] = row[key] / (floor * 1e3)
    return {
        "benchmark": "tensor_parallel",
        "device": device_name(),
        "num_devices": torch.cuda.device_count() if on_gpu else 0,
        "shape": SMOKE_SHAPE if args.smoke else args.shape,
        "dtype": "bfloat16" if on_gpu else "float32",
        "weights": "dummy",
        "ignore_eos": True,
        "async_scheduling": False,
        "tp": args.tp,
        "context": args.context,
        "copy_GB_per_s": None if bandwidth is None else bandwidth / 1e9,
        "collectives": collectives,
        "rows": rows,
        "summary_config": tp_row["config"],  # the last TP > 1 row measured
        "summary": {
            **{f"ttft_{n}_speedup": tp_row[f"ttft_{n}_speedup"] for n in args.prompt_lens},
            **{f"step_b{b}_speedup": tp_row[f"step_b{b}_speedup"] for b in args.batches},
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--reps-collective", type=int, default=50)
    parser.add_argument("--big-bytes", type=int, default=BIG_ALL_REDUCE_BYTES)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, few steps")
    parser.add_argument("--serve", action="store_true", help="serve a too-big model instead")
    parser.add_argument("--prefill", type=int, default=1, help="serve: prefill workers (0, 1)")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="serve: the stack's depth")
    parser.add_argument("--serve-requests", type=int, default=4)
    parser.add_argument("--serve-prompt-len", type=int, default=1024)
    parser.add_argument("--serve-tokens", type=int, default=32)
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=["tp1-eager", "tpN", "tpN-graphs"],
        default=["tp1-eager", "tpN", "tpN-graphs"],
        help="rows beside the TP=1 baseline (eager ones and graphs rows on GPUs only)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompt_lens, args.batches, args.context = [48, 96], [1, 4], 32
        args.steps, args.reps, args.reps_collective = 4, 2, 5
        args.big_bytes, args.num_kv_blocks = 1 << 20, 64
        args.serve_requests, args.serve_prompt_len, args.serve_tokens = 2, 40, 8
    if args.serve:
        from bench.tensor_parallel_serve import serve_mode

        result = serve_mode(args)
    else:
        result = engine_mode(args)
    out = args.out or f"bench/results/tensor_parallel{'_serve' if args.serve else ''}.json"
    write_results(out, result)
    if args.serve:
        print(
            f"{result['device']}: {result['shape']}, P TP={args.prefill_tp} x{args.prefill}, "
            f"D TP={args.decode_tp}"
        )
        print(table(result["rows"], ["request", "ttft_ms", "tokens", "e2e_ms"]))
        return result
    coll = result["collectives"]
    print(f"{result['device']} x{args.tp}, {result['shape']}, {result['dtype']}, dummy weights")
    print(
        f"all-reduce {coll['all_reduce_bytes'] >> 20} MiB: {coll['all_reduce_ms']:.3f} ms, "
        f"bus {coll['bus_GB_per_s']:.1f} GB/s; copy {result['copy_GB_per_s']} GB/s"
    )
    print(
        table(
            [{"tokens": k, **v} for k, v in coll["step"].items()],
            ["tokens", "bytes", "one_all_reduce_us", "per_step_ms"],
        )
    )
    columns = ["config", "cuda_graphs"]
    columns += [f"ttft_{n}_{s}" for n in args.prompt_lens for s in ("ms", "speedup")]
    columns += [f"step_b{b}_{s}" for b in args.batches for s in ("ms", "speedup")]
    if result["copy_GB_per_s"] is not None:
        columns += [f"step_b{b}_{s}" for b in args.batches for s in ("floor_ms", "vs_floor")]
    if any("error" in row for row in result["rows"]):
        columns.append("error")
    print(table(result["rows"], columns))
    return result


if __name__ == "__main__":
    main()
