"""Multi-LoRA throughput: a batch of 64 with 1, 8 and 32 distinct rank-16 adapters against the
base model, in the same run; and how long an adapter takes to swap into a device slot.

    python -m bench.lora [--shape llama-3-8b] [--batch 64] [--adapters 1,8,32] [--rank 16]
        [--context 512] [--prompt-len 512] [--steps 40] [--out bench/results/lora.json]
    python -m bench.lora --smoke    # the CPU, a tiny model: that it runs, not its speed

Random bf16 weights of the shape (load_format="dummy") and random adapters of every projection
(q/k/v/o/gate/up/down) at the given rank, made in memory (no files). Row i of a batch runs
adapter i mod N, so every adapter has batch/N rows. Decode: after the prompts (`--context`
tokens each) are in, the steady-state seconds per decode step of the whole batch (CUDA
graphs, overlapped steps as the engine defaults), as output tokens/s. Prefill: `--batch`
prompts of `--prompt-len` tokens, one output token each, from queued to finished, as prompt
tokens/s. Each with-adapter figure is also given as a ratio of the base model's in the same
run. Swap-in: median time of one adapter's host-to-device copy into a slot (synchronised).
EOS is ignored throughout.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    check_whole_batch,
    decode_room,
    device_name,
    model_dir,
    sync,
    table,
    write_results,
)


def random_adapter(name: str, engine: Any, rank: int, seed: int) -> Any:
    """An adapter of every projection at `rank`, random weights of a trained LoRA's scale."""
    from splitserve.engine.lora.adapter import PROJECTIONS, LoRAAdapter, projection_shape

    cfg = engine.model_config
    device = engine.platform.device
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = engine.config.dtype
    weights = {}
    for layer in range(cfg.num_layers):
        for module in PROJECTIONS:
            in_f, out_f = projection_shape(cfg, module)
            a = torch.randn(rank, in_f, generator=gen, device=device) * in_f**-0.5
            b = torch.randn(out_f, rank, generator=gen, device=device) * 0.01
            weights[(layer, module)] = (a.to(dtype).cpu(), b.to(dtype).cpu())
    return LoRAAdapter(
        name=name,
        path="(random)",
        rank=rank,
        scale=2.0,
        target_modules=frozenset(PROJECTIONS),
        weights=weights,
        digest=f"random-{seed}",
    )


def _names(batch: int, num_adapters: int) -> list[str | None]:
    return [None if num_adapters == 0 else f"lora{i % num_adapters}" for i in range(batch)]


def _finish(engine: Any) -> None:
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(seq.request_id)


def decode_tokens_per_s(engine: Any, names: list[str | None], context: int, steps: int) -> float:
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=decode_room(engine, context), ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i, name in enumerate(names):
        prompt = [(10 + 7 * i + j) % (vocab - 10) + 5 for j in range(context)]
        engine.add_request(prompt, params, lora_request=name)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):  # fill the overlap pipeline; graphs warm
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    check_whole_batch(engine, len(names))
    _finish(engine)
    return len(names) / seconds


def prefill_tokens_per_s(engine: Any, names: list[str | None], prompt_len: int) -> float:
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    sync()
    start = time.perf_counter()
    for i, name in enumerate(names):
        # NOTE: prompts differ from their first token: no prefix-cache hit between them.
        prompt = [(11 + 13 * i + j) % (vocab - 10) + 5 for j in range(prompt_len)]
        engine.add_request(prompt, params, lora_request=name)
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return len(names) * prompt_len / (time.perf_counter() - start)


def swap_in_ms(engine: Any, names: list[str], reps: int = 10) -> float:
    """Median time to bring an evicted adapter back into a slot (host to device, synced)."""
    lora = engine.lora
    times = []
    for i in range(reps):
        name = names[i % len(names)]
        lora.evict(name)
        sync()
        start = time.perf_counter()
        lora.slots_for([name])
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", default="1,8,32", help="distinct adapters per batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="bench/results/lora.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()
    counts = [int(n) for n in args.adapters.split(",")]
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig

    if args.smoke:
        args.batch, args.context, args.prompt_len, args.steps = 8, 24, 24, 3
        counts = [1, 2, 4]
    # NOTE: + the tokens the first rows decode while the rest prefill (bench.common.decode_room)
    max_len = (
        max(args.context, args.prompt_len) + args.steps + 64 + args.batch * args.context // 2048
    )
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from splitserve.testing.tiny_model import make_tiny_model

            path = make_tiny_model(Path(tmp) / "tiny", "llama")
            device, dtype, load_format = "cpu", torch.float32, "safetensors"
        else:
            assert torch.cuda.is_available(), "this benchmark needs a GPU (or --smoke)"
            path = model_dir(args.shape, Path(tmp))
            device, dtype, load_format = "cuda", torch.bfloat16, "dummy"
        gc.collect()
        engine = LLMEngine(
            path,
            EngineConfig(
                dtype=dtype,
                device=device,
                load_format=load_format,
                max_num_seqs=args.batch,
                max_model_len=max_len,
                max_num_batched_tokens=max(8192, args.prompt_len),
                enable_prefix_caching=False,
                enable_lora=True,
                max_loras=max(counts),
                max_lora_rank=args.rank,
            ),
        )
        assert engine.lora is not None
        names = [f"lora{i}" for i in range(max(counts))]
        for i, name in enumerate(names):
            engine.lora.add(random_adapter(name, engine, args.rank, seed=i + 1))
        for n in (0, max(counts)):  # NOTE: compile and autotune before any row is timed
            prefill_tokens_per_s(engine, _names(8, n), args.prompt_len)
        rows: list[dict[str, Any]] = []
        base: dict[str, float] = {}
        for n in [0, *counts]:
            batch_names = _names(args.batch, n)
            decode = decode_tokens_per_s(engine, batch_names, args.context, args.steps)
            prefill = prefill_tokens_per_s(engine, batch_names, args.prompt_len)
            if n == 0:
                base = {"decode": decode, "prefill": prefill}
            rows.append(
                {
                    "adapters": n or "base",
                    "decode tok/s": decode,
                    "decode x base": decode / base["decode"],
                    "decode ms/step": args.batch / decode * 1e3,
                    "prefill tok/s": prefill,
                    "prefill x base": prefill / base["prefill"],
                }
            )
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()},
                  flush=True)  # fmt: skip
        swap = swap_in_ms(engine, names)
        engine.check_integrity()
    print(
        f"{device_name()}, {'tiny llama (smoke)' if args.smoke else args.shape}, "
        f"{str(dtype).removeprefix('torch.')}, batch {args.batch}, rank {args.rank}, "
        f"context {args.context}, prompt {args.prompt_len}, EOS ignored"
    )
    columns = ["adapters", "decode tok/s", "decode x base", "decode ms/step", "prefill tok/s",
               "prefill x base"]  # fmt: skip
    print(table(rows, columns))
    print(f"adapter swap-in: {swap:.2f} ms (median)")
    write_results(
        args.out,
        {
            "device": device_name(),
            "shape": "tiny-llama" if args.smoke else args.shape,
            "dtype": str(dtype),
            "batch": args.batch,
            "rank": args.rank,
            "context": args.context,
            "prompt_len": args.prompt_len,
            "steps": args.steps,
            "ignore_eos": True,
            "rows": rows,
            "swap_in_ms": swap,
        },
    )


if __name__ == "__main__":
    main()
