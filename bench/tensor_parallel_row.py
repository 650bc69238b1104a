"""One configuration (row) of bench/tensor_parallel.py, in a process of its own.

    python -m bench.tensor_parallel_row '<spec as JSON>'

It starts one engine (TP=1 or TP=N, graphs or eager), measures, and prints two kinds of lines
on stdout as it goes: timestamped progress, and `@@ {json}` with each measurement, so that the
parent keeps what a row measured even if the row is later killed at its time limit. A row in a
process of its own can't leave GPU memory, NCCL state or a hung collective to the next one.

Measurement order (the acceptance's figures first): the shortest prompt's TTFT, the decode
steps, then the longer prompts' TTFTs.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import check_whole_batch, decode_room, device_name, sync
from splitserve.engine.parallel.peer_all_reduce import DEFAULT_MAX_BYTES

RESULT_PREFIX = "@@ "
RESULT_FD_ENV = "SPLITSERVE_BENCH_RESULT_FD"  # where `emit` writes, if set
_T0 = time.monotonic()


def progress(text: str) -> None:
    """A timestamped line (wall clock, and seconds since this process started)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.monotonic() - _T0:5.1f}s] {text}", flush=True)


def emit(**fields: Any) -> None:
    """Measurements for the parent (bench/row_process.py reads them line by line): on the pipe
    it gave (RESULT_FD_ENV) when it gave one, which nothing else writes to (the follower ranks
    share stdout and stderr, and a line of theirs can land inside ours), else on stdout."""
    line = RESULT_PREFIX + json.dumps(fields) + "\n"
    fd = os.environ.get(RESULT_FD_ENV)
    if fd is None:
        print(line, end="", flush=True)
        return
    data = line.encode()
    while data:
        data = data[os.write(int(fd), data) :]


def random_prompt(length: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(10, vocab, (length,), generator=gen).tolist()


def ttft(engine, length: int, reps: int) -> float:
    """Median seconds from add_request to the first token of a fresh `length`-token prompt."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(length)
    vocab = engine.model_config.vocab_size
    times = []
    for rep in range(reps + 1):  # NOTE: the first is a warm-up (kernels compile at this shape)
        prompt = random_prompt(length, vocab, gen)
        sync()
        start = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step(engine, batch: int, context: int, steps: int) -> float:
    """Median seconds of an engine step while `batch` sequences of `context` tokens decode."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=decode_room(engine, context), ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(random_prompt(context, engine.model_config.vocab_size, gen), params)
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
    check_whole_batch(engine, batch)
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


def _measure_ttft(engine, name: str, length: int, reps: int) -> None:
    value = ttft(engine, length, reps) * 1e3
    emit(**{f"ttft_{length}_ms": value})
    progress(f"{name}: TTFT at {length} tokens: {value:.2f} ms")


def run(spec: dict) -> None:
    """Start the engine `spec` describes and emit its measurements one by one."""
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig

    name, on_gpu = spec["name"], spec["on_gpu"]
    lengths, batches = sorted(spec["prompt_lens"]), spec["batches"]
    config = EngineConfig(
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        device="cuda:0" if on_gpu else "cpu",
        load_format="dummy",
        tensor_parallel_size=spec["tp"],
        enable_cuda_graphs=spec["graphs"],
        tensor_parallel_cuda_graphs=spec["tp_graphs"],
        tensor_parallel_peer_all_reduce_bytes=DEFAULT_MAX_BYTES if spec.get("peer") else 0,
        # NOTE: TP > 1 can't overlap steps (engine/overlap.py), so no configuration does: the
        # rows differ in degree and graphs only.
        async_scheduling=False,
        enable_prefix_caching=False,
        # NOTE: room for what the first rows decode while the rest prefill (bench.common)
        max_model_len=max(lengths[-1], spec["context"] + spec["steps"] + 16)
        + 16
        + max(batches) * spec["context"] // max(lengths[-1], max(batches)),
        max_num_batched_tokens=max(lengths[-1], max(batches)),
        max_num_seqs=max(batches),
        num_kv_blocks=spec["num_kv_blocks"],
    )
    progress(f"{name}: starting the engine (TP={spec['tp']}, graphs {spec['graphs']})")
    start = time.perf_counter()
    engine = LLMEngine(Path(spec["model"]), config)
    up_s = time.perf_counter() - start
    progress(f"{name}: engine up in {up_s:.1f} s")
    local = engine.model.cfg
    emit(
        device=device_name(),
        engine_up_s=up_s,
        cuda_graphs=engine.runner.graphs is not None,
        peer_all_reduce=engine.followers is not None
        and engine.followers.group is not None
        and engine.followers.group.peer_all_reduce,
        weight_bytes_rank0=rank_weight_bytes(engine),
        kv_bytes_per_token_rank0=2
        * local.num_layers
        * local.num_kv_heads
        * local.head_dim
        * engine.kv_cache.pool.element_size(),
    )
    try:
        for length in lengths[:1]:
            _measure_ttft(engine, name, length, spec["reps"])
        for batch in batches:
            step = decode_step(engine, batch, spec["context"], spec["steps"]) * 1e3
            emit(**{f"step_b{batch}_ms": step})
            progress(f"{name}: decode step at batch {batch}: {step:.3f} ms")
        for length in lengths[1:]:
            _measure_ttft(engine, name, length, spec["reps"])
        emit(complete=True)
    finally:
        progress(f"{name}: stopping the engine")
        engine.shutdown()
    progress(f"{name}: done")


def main(argv: list[str]) -> None:
    # NOTE: the tensor-parallel launcher's lines (followers started, ranks joined) with times.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("splitserve.engine.parallel").setLevel(logging.INFO)
    run(json.loads(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
