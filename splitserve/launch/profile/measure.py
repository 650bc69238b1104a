"""Measuring the curves with the offline engine, in this process, through its public calls
(`add_request`, `step`, `abort_request`): what a worker's engine core runs, less the service.

Prefill: one prompt at a time, the engine otherwise idle, from `add_request` to its first
token (one untimed run per length first: kernels compile per shape); the median of
`repeats`. Decode: `batch` prompts of `context_len` tokens, stepped until every one has its
first token, then `steps` steps timed: the median step (or, where steps overlap, the median
of three rounds' mean), so that a busy host's stray stall does not move the figure. A
point the engine cannot hold whole (its KV pool, its context) is left out, and said so.
The prefix cache is off: a measurement never reuses an earlier one's blocks.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from splitserve.engine.parallel.sharding import check_divisible as check_divisible
from splitserve.engine.platform import resolve_device as resolve_device
from splitserve.engine.platform import resolve_dtype
from splitserve.engine.quantization import weight_bytes
from splitserve.launch.profile.curves import Curves, DecodePoint, PrefillPoint

Progress = Callable[[str], None]
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Grid:
    prefill_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int = 16
    repeats: int = 3

    def __post_init__(self) -> None:
        values = (*self.prefill_lens, *self.decode_batches, *self.decode_contexts)
        if not (self.prefill_lens and self.decode_batches and self.decode_contexts):
            raise ValueError("the grid needs at least one prompt length, batch and context")
        if min(values) < 1 or self.decode_steps < 1 or self.repeats < 1:
            raise ValueError("grid lengths, batches, steps and repeats must be at least 1")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()}"


def device_count(device: str) -> int:
    return torch.cuda.device_count() if device.startswith("cuda") else 1


def device_memory_bytes(device: str) -> int:
    """One GPU's memory (0 on the CPU): what workers that share a GPU divide (`--check`)."""
    return torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda") else 0


def fitting_degrees(model: ModelConfig, num_devices: int) -> tuple[int, ...]:
    """Powers of two up to `num_devices` that split this model's heads and MLP."""
    found, tp = [], 1
    while tp <= num_devices:
        try:
            check_divisible(model, tp)
            found.append(tp)
        except ValueError:
            pass
        tp *= 2
    return tuple(found)


def dtype_name(model: ModelConfig, dtype: str, device: str) -> str:
    """What "auto" (or any name) resolves to here, e.g. "bfloat16"."""
    return str(resolve_dtype(dtype, device, model.torch_dtype)).removeprefix("torch.")


def kv_bytes_per_token(model: ModelConfig, dtype: str, device: str) -> int:
    """K and V of one token over every layer, in the dtype the engine would run."""
    size = torch.empty((), dtype=resolve_dtype(dtype, device, model.torch_dtype)).element_size()
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * size


def build_engine(
    model_dir: str,
    device: str,
    dtype: str,
    max_model_len: int | None,
    tp: int,
    max_seqs: int,
    load_format: str = "safetensors",
) -> LLMEngine:
    """The engine a worker of degree `tp` would run; `load_format` "dummy": random weights of
    the checkpoint's shape (a model directory of config.json and tokenizer is enough)."""
    checkpoint = ModelConfig.from_pretrained(model_dir).torch_dtype
    config = EngineConfig(
        dtype=resolve_dtype(dtype, device, checkpoint),
        device=device,
        max_model_len=max_model_len,
        fit_max_model_len_to_pool=max_model_len is None,
        enable_prefix_caching=False,
        max_num_seqs=max(max_seqs, 1),
        tensor_parallel_size=tp,
        load_format=load_format,
    )
    return LLMEngine(model_dir, config)


def _sync(engine: LLMEngine) -> None:
    if engine.config.device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompt(engine: LLMEngine, length: int, salt: int) -> list[int]:
    span = max(2, min(5000, engine.model_config.vocab_size - 10))
    return [10 + (salt * 7919 + j * 31 + j // span) % span for j in range(length)]


def _drain(engine: LLMEngine) -> list[Any]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def prefill_seconds(engine: LLMEngine, length: int, salt: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    _sync(engine)
    start = time.perf_counter()
    engine.add_request(_prompt(engine, length, salt), params)
    _drain(engine)
    _sync(engine)
    return time.perf_counter() - start


def _median_step_s(engine: LLMEngine, steps: int) -> float:
    """The median over rounds of back-to-back steps, each round closed by a device sync: a
    round of one step where steps run synchronously (the CPU), three rounds where they
    overlap (a step returns while it runs: only a round's end shows its period)."""
    rounds = min(3, steps) if engine.overlap else steps
    per_round, times = steps // rounds, []
    for _ in range(rounds):
        _sync(engine)
        start = time.perf_counter()
        for _ in range(per_round):
            engine.step()
        _sync(engine)
        times.append((time.perf_counter() - start) / per_round)
    return statistics.median(times)


def decode_point(
    engine: LLMEngine, batch: int, context_len: int, steps: int, salt: int
) -> DecodePoint | str:
    """The point, or why it was left out."""
    room = engine.max_model_len - context_len
    fill = batch * context_len // engine.config.max_num_batched_tokens + 2
    if room < steps + WARMUP_STEPS + fill + 1:
        return f"context {context_len} + {steps} steps exceeds max_model_len {engine.max_model_len}"
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    ids = [
        engine.add_request(_prompt(engine, context_len, salt * 1009 + i), params)
        for i in range(batch)
    ]
    generated: dict[str, int] = {}
    try:
        for _ in range(fill + batch * context_len + 8):  # NOTE: a bound, not an expectation
            for out in engine.step():
                generated[out.request_id] = len(out.outputs[0].token_ids)
            if len(generated) == batch:
                break
        if len(generated) < batch or engine.num_running_seqs() < batch:
            return f"batch {batch} × {context_len} tokens does not fit the engine's KV pool"
        for _ in range(WARMUP_STEPS):
            engine.step()
        before = statistics.fmean(generated.values()) + WARMUP_STEPS
        step_s = _median_step_s(engine, steps)
        if engine.num_running_seqs() < batch:
            return f"batch {batch} × {context_len} tokens was preempted while timed"
    finally:
        for rid in ids:
            engine.abort_request(rid)
        _drain(engine)
    return DecodePoint(batch, context_len, round(context_len + before + steps / 2), step_s)


def measure(engine: LLMEngine, tp: int, grid: Grid, progress: Progress) -> tuple[Curves, list[str]]:
    """One TP degree's curves, each point reported as it is measured; and the points left out."""
    skipped: list[str] = []
    prefill = []
    salt = 1
    usable = [n for n in grid.prefill_lens if n < engine.max_model_len]
    skipped += [f"prompt {n} ≥ max_model_len" for n in grid.prefill_lens if n not in usable]
    for length in usable:
        prefill_seconds(engine, length, salt)  # untimed: compiles and warms this shape
        times = [prefill_seconds(engine, length, salt + 1 + r) for r in range(grid.repeats)]
        salt += grid.repeats + 1
        point = PrefillPoint(length, statistics.median(times))
        prefill.append(point)
        progress(
            f"  TP{tp} prefill {length:>6} tokens: {point.seconds * 1e3:9.2f} ms "
            f"({length / point.seconds:,.0f} tokens/s)"
        )
    decode = []
    for context in grid.decode_contexts:
        for batch in grid.decode_batches:
            salt += batch + 1
            got = decode_point(engine, batch, context, grid.decode_steps, salt)
            if isinstance(got, str):
                skipped.append(got)
                progress(f"  TP{tp} decode batch {batch:>4}, context {context:>6}: skipped: {got}")
                continue
            decode.append(got)
            progress(
                f"  TP{tp} decode batch {batch:>4}, context {got.context_len:>6}: "
                f"{got.step_s * 1e3:9.2f} ms/step ({batch / got.step_s:,.0f} tokens/s)"
            )
    return Curves(tp, tuple(prefill), tuple(decode)), skipped


def measure_degrees(
    model_dir: str,
    device: str,
    dtype: str,
    max_model_len: int | None,
    degrees: Sequence[int],
    grid: Grid,
    progress: Progress,
    load_format: str = "safetensors",
) -> tuple[list[Curves], list[str], int]:
    """Every degree's curves (an engine each, shut down after; with one rank's weight bytes),
    what was skipped, and the max_model_len the engines ran with."""
    found, skipped, model_len = [], [], max_model_len or 0
    for tp in degrees:
        dummy = " (dummy weights)" if load_format == "dummy" else ""
        progress(f"TP{tp}: loading {model_dir}{dummy} on {device} …")
        engine = build_engine(
            model_dir, device, dtype, max_model_len, tp, max(grid.decode_batches), load_format
        )
        try:
            model_len = engine.max_model_len
            curves, left_out = measure(engine, tp, grid, progress)
            curves = dataclasses.replace(curves, weight_bytes=weight_bytes(engine.model))
        finally:
            engine.shutdown()
        found.append(curves)
        skipped += [f"TP{tp}: {why}" for why in left_out]
    return found, skipped, model_len
