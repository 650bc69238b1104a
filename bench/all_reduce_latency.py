"""One all-reduce's latency as a tensor-parallel decode step pays it: `--ops` all-reduces captured
back to back in one CUDA graph on each of N ranks, the graph replayed, GPU time per all-reduce.
NCCL's own all-reduce and the peer-memory one-shot (engine/parallel/peer_all_reduce.py) at each
size, and a graph of the same shape with each all-reduce replaced by a local add (what the graph
costs without the link) as the baseline, all in one run. Two GPUs or more.

    python -m bench.all_reduce_latency --out bench/results/all_reduce_latency.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import torch

from bench.common import table, write_results
from bench.tensor_parallel_collectives import _await_result, _free_port


def _graph_us(fn, x: torch.Tensor, ops: int, replays: int) -> float:
    """GPU microseconds per op of a graph of `ops` calls of fn(x), replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * ops)


def _rank(rank: int, size: int, port: int, spec: dict, out) -> None:
    from splitserve.engine.parallel.group import Rendezvous, TorchGroup
    from splitserve.engine.parallel.peer_all_reduce import DEFAULT_MAX_BYTES
    from splitserve.engine.parallel.sharding import Shard

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    group = TorchGroup(
        Shard(rank, size),
        Rendezvous("127.0.0.1", port, 120, 120),
        dev,
        peer_all_reduce_bytes=DEFAULT_MAX_BYTES,
    )
    peer = group._peer

    def nccl(x: torch.Tensor) -> None:
        group._pg.allreduce([x]).wait()

    def local(x: torch.Tensor) -> None:
        x.add_(1)

    rows: list[dict[str, Any]] = []
    for nbytes in spec["bytes"]:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        row: dict[str, Any] = {"bytes": nbytes, "local_add_us": _graph_us(local, x, **spec["g"])}
        row["nccl_us"] = _graph_us(nccl, x, **spec["g"])
        if peer is not None and peer.fits(x):
            row["peer_us"] = _graph_us(peer, x, **spec["g"])
            if nbytes <= (1 << 20):
                row["one_shot_us"] = _graph_us(peer.one_shot, x, **spec["g"])
        rows.append(row)
    if rank == 0:
        out.put({"peer_all_reduce": peer is not None, "rows": rows})
    group.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--bytes", type=int, nargs="+", default=[8192, 65536, 1 << 20, 32 << 20])
    parser.add_argument("--ops", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    spec = {"bytes": args.bytes, "g": {"ops": args.ops, "replays": args.replays}}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.tp, port, spec, out), daemon=True)
        for r in range(args.tp)
    ]
    for p in procs:
        p.start()
    try:
        result = _await_result(out, procs, time.monotonic() + args.timeout_s, args.timeout_s)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    result.update(tp=args.tp, device=torch.cuda.get_device_name(0), ops_per_graph=args.ops)
    print(f"{result['device']} x{args.tp}: GPU us per all-reduce, {args.ops} in one CUDA graph")
    cols = ["bytes", "local_add_us", "nccl_us", "peer_us", "one_shot_us"]
    print(table(result["rows"], cols))
    if args.out:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
