"""The collectives part of bench/tensor_parallel.py: all-reduce bus bandwidth and the all-reduces
of one step, in a fresh group of N processes (NCCL on GPUs, gloo on the CPU)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import torch

from bench.common import sync


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_all_reduce(group, x: torch.Tensor, reps: int) -> float:
    for _ in range(3):
        group.all_reduce(x)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        group.all_reduce(x)
    sync()
    return (time.perf_counter() - start) / reps


def _collective_rank(rank: int, size: int, port: int, device: str, spec: dict, out) -> None:
    from splitserve.engine.parallel.group import Rendezvous, TorchGroup
    from splitserve.engine.parallel.sharding import Shard

    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = TorchGroup(Shard(rank, size), Rendezvous("127.0.0.1", port), dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    big = torch.ones(spec["big_bytes"] // elem, dtype=dtype, device=dev)
    seconds = _time_all_reduce(group, big, spec["reps"])
    result: dict[str, Any] = {
        "all_reduce_bytes": spec["big_bytes"],
        "all_reduce_ms": seconds * 1e3,
        "bus_GB_per_s": spec["big_bytes"] * 2 * (size - 1) / size / seconds / 1e9,
        "step": {},
    }
    for tokens in spec["tokens"]:
        x = torch.ones(tokens, spec["hidden"], dtype=dtype, device=dev)
        one = _time_all_reduce(group, x, spec["reps"])
        result["step"][str(tokens)] = {
            "one_all_reduce_us": one * 1e6,
            "per_step_ms": one * spec["per_step"] * 1e3,
            "bytes": x.numel() * elem,
        }
    group.close()
    if rank == 0:
        out.put(result)


def measure_collectives(
    size: int, device: str, hidden: int, layers: int, tokens: list[int], big_bytes: int, reps: int
) -> dict:
    """All-reduce bus bandwidth and per-step all-reduce time in a fresh group of `size`
    processes (before any engine holds the GPUs)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    spec = {
        "hidden": hidden,
        "tokens": tokens,
        "big_bytes": big_bytes,
        "reps": reps,
        "per_step": 2 * layers + 1,
    }
    port = _free_port()
    procs = [
        ctx.Process(target=_collective_rank, args=(r, size, port, device, spec, out))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return result
