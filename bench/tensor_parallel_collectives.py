"""The collectives part of bench/tensor_parallel.py: all-reduce bus bandwidth and the all-reduces
of one step, in a fresh group of N processes (NCCL on GPUs, gloo on the CPU); on a GPU, rank 0
also measures the device's copy bandwidth (the decode floor's denominator) and names it.

Bounded: the parent polls for the result, fails at once (naming the rank) if a rank dies, and
at `timeout_s` kills every rank; rank 0 hands its result over before it releases the group, so
a backend that is slow to tear down costs nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from typing import Any

import torch

from bench.common import device_name, sync
from splitserve.engine.parallel.peer_all_reduce import DEFAULT_MAX_BYTES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_all_reduce(all_reduce, x: torch.Tensor, reps: int) -> float:
    for _ in range(3):
        all_reduce(x)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        all_reduce(x)
    sync()
    return (time.perf_counter() - start) / reps


def _backend_all_reduce(group):
    """The backend's own all-reduce (NCCL or gloo), past any peer-memory path."""

    def run(x: torch.Tensor) -> torch.Tensor:
        group._pg.allreduce([x]).wait()
        return x

    return run


def _collective_rank(rank: int, size: int, port: int, device: str, spec: dict, out) -> None:
    from splitserve.engine.parallel.group import Rendezvous, TorchGroup
    from splitserve.engine.parallel.sharding import Shard

    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    extra: dict[str, Any] = {}
    if rank == 0:  # NOTE: before the group: a peer's release of it need not wait for this
        extra = {"device": device_name(), "copy_GB_per_s": None}
        if dev.type == "cuda":
            from bench.kernels import copy_bandwidth

            extra["copy_GB_per_s"] = copy_bandwidth(2 << 30, dev)["GB_per_s"]
            torch.cuda.empty_cache()
    timeout = spec["timeout_s"]
    rendezvous = Rendezvous("127.0.0.1", port, timeout, timeout)
    peer_bytes = DEFAULT_MAX_BYTES if dev.type == "cuda" else 0
    group = TorchGroup(Shard(rank, size), rendezvous, dev, peer_all_reduce_bytes=peer_bytes)
    backend = _backend_all_reduce(group)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    big = torch.ones(spec["big_bytes"] // elem, dtype=dtype, device=dev)
    seconds = _time_all_reduce(backend, big, spec["reps"])
    del big
    result: dict[str, Any] = {
        "backend": group.backend,
        "peer_all_reduce": group.peer_all_reduce,
        "all_reduce_bytes": spec["big_bytes"],
        "all_reduce_ms": seconds * 1e3,
        "bus_GB_per_s": spec["big_bytes"] * 2 * (size - 1) / size / seconds / 1e9,
        "step": {},
    }
    for tokens in spec["tokens"]:
        x = torch.ones(tokens, spec["hidden"], dtype=dtype, device=dev)
        one = _time_all_reduce(backend, x, spec["reps"])
        row = result["step"][str(tokens)] = {
            "one_all_reduce_us": one * 1e6,
            "per_step_ms": one * spec["per_step"] * 1e3,
            "bytes": x.numel() * elem,
        }
        peer = group._peer
        if peer is not None and peer.fits(x):
            # NOTE: what the engine takes at this size, then each kind alone (each checked:
            # the sum of 1..size in every element)
            seconds = _time_all_reduce(group.all_reduce, x, spec["reps"])
            row["peer_all_reduce_us"] = seconds * 1e6
            row["peer_per_step_ms"] = seconds * spec["per_step"] * 1e3
            ok = True
            kinds = {"one_shot": peer.one_shot, "two_shot": peer.two_shot}
            if x.numel() % size:
                del kinds["two_shot"]
            for kind, fn in kinds.items():
                row[f"{kind}_us"] = _time_all_reduce(fn, x, spec["reps"]) * 1e6
                x.fill_(rank + 1)
                fn(x)
                ok = ok and bool((x == size * (size + 1) / 2).all().item())
            row["peer_sum_ok"] = ok
    if rank == 0:
        out.put({**result, **extra})
    group.close()


def measure_collectives(
    size: int,
    device: str,
    hidden: int,
    layers: int,
    tokens: list[int],
    big_bytes: int,
    reps: int,
    timeout_s: float = 180.0,
) -> dict:
    """All-reduce bus bandwidth and per-step all-reduce time in a fresh group of `size`
    processes (before any engine holds the GPUs). Raises RuntimeError if a rank dies or the
    whole takes longer than `timeout_s`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    spec = {
        "hidden": hidden,
        "tokens": tokens,
        "big_bytes": big_bytes,
        "reps": reps,
        "per_step": 2 * layers + 1,
        "timeout_s": timeout_s,
    }
    port = _free_port()
    # NOTE: daemonic, so that a rank stuck in the backend can never hold this process's exit.
    procs = [
        ctx.Process(target=_collective_rank, args=(r, size, port, device, spec, out), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        result = _await_result(out, procs, deadline, timeout_s)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return result


def _await_result(out, procs: list, deadline: float, timeout_s: float) -> dict:
    while True:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            pass
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"collectives: rank(s) exited with codes {failed}")
        if all(p.exitcode == 0 for p in procs):
            try:  # NOTE: rank 0 flushed its result before it exited
                return out.get(timeout=2.0)
            except queue.Empty:
                raise RuntimeError("collectives: ranks exited; rank 0 sent no result") from None
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            raise RuntimeError(f"collectives: no result in {timeout_s:.0f} s (alive: {alive})")
