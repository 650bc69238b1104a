"""DESIGN benchmark 5: KV transfer between two worker processes, per transport.

    PYTHONPATH=. python -m bench.kv_transfer [--shape llama-3-8b] [--tokens 1024 4096 16384]
        [--transports nixl grpc] [--repeats 5] [--out bench/results/kv_transfer.json]
    python -m bench.kv_transfer --smoke     # CPU, tiny model, float32: checks that it runs

A prefill engine P (this process, cuda:0) pushes KV blocks to a decode engine D (a spawned
process, cuda:1) with each transport's real sender and receiver: D serves `KVTransferServicer`
over gRPC on a loopback port and runs a `NixlReceiver`, both landing into a `ReservationBook`.
Prompts are random token ids; prefix caching is off on both engines, so nothing is ever cached
and one prompt can be pushed again to a fresh reservation. Times are `time.monotonic_ns()`,
one system-wide clock that both processes read.

- transfer: a prompt prefilled on P (`prefill_only`, watched from block 0, nothing pushed
  meanwhile), then ALL its pinned blocks in ONE Push to blocks reserved on D. Timed from just
  before `sender.push` (P's GPU idle) until `engine.admit` returned on D (after
  `wait_complete`). One warm-up push, then the median of --repeats pushes of the same blocks to
  fresh reservations; the first push of a transport (connection setup included) is "first push".
  GB/s = blocks * block bytes / seconds. The warm-up's landed blocks are checked on D against a
  CRC-32C of P's blocks.
- pipelined, as the service runs: P prefills in chunks of --chunk tokens while a sender thread
  pushes each batch the connector reports and releases it. exposed = t(D admitted) - t(P's last
  step done, its compute stream synchronised, so the last batch's `ready` event has passed);
  xfer/prefill = exposed / P's prefill wall time. Step ms: median engine step (compute stream
  synchronised) of those prefills, and of the same prompt prefilled without a watch just
  before each, --repeats times each.
- ceilings: GPU->GPU copy cuda:0 -> cuda:1 and device -> pinned host (1 GiB, CUDA events,
  median); on the CPU a host memcpy instead. "% of ceil" = transfer GB/s / the first ceiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import random
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import SHAPES, median_time, model_dir, table, write_results
from bench.kv_transfer_decode import decode_main, device_label
from bench.kv_transfer_prefill import BenchError, DecodeSide, pipelined, transfer_only
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kv_transfer.transport import Peer, transport_kind

TRANSPORTS = ["nixl", "grpc"]
DEFAULTS = [  # option, full run, --smoke
    ("tokens", [1024, 4096, 16384], [40, 130]), ("repeats", 5, 2), ("chunk", 2048, 32),
    ("devices", ["cuda:0", "cuda:1"], ["cpu", "cpu"]),
]  # fmt: skip
COLUMNS = [
    "transport", "tokens", "MB", "transfer ms", "GB/s", "% of ceil", "first push ms",
    "exposed ms", "xfer/prefill %", "step ms with", "step ms w/o", "ratio",
]  # fmt: skip


# -- ceilings, setup and the run -----------------------------------------------------------------


def _cuda_copy_gbps(dst: torch.Tensor, src: torch.Tensor, reps: int = 10) -> float:
    """GB/s of the median src -> dst copy, timed with CUDA events on the source device's
    stream (where a peer copy runs), after two warm-up copies."""
    times = []
    with torch.cuda.device(src.device):
        for i in range(reps + 2):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times += [start.elapsed_time(end) / 1e3] if i >= 2 else []
    return src.nbytes / statistics.median(times) / 1e9


def ceilings(devices: list[str]) -> dict[str, float]:
    """Copy bandwidths (GB/s, bytes moved once) on this host; the first is the reference."""
    if not devices[0].startswith("cuda"):
        host_src, host_dst = (torch.ones(64 << 20, dtype=torch.uint8) for _ in range(2))
        seconds = median_time(lambda: host_dst.copy_(host_src), reps=10)
        return {"host memcpy": host_src.nbytes / seconds / 1e9}
    src = torch.ones(1 << 30, dtype=torch.uint8, device=devices[0])
    peer = torch.empty_like(src, device=devices[1])
    host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    result = {
        f"GPU->GPU {devices[0]}->{devices[1]}": _cuda_copy_gbps(peer, src),
        f"{devices[0]}->pinned host": _cuda_copy_gbps(host, src),
    }
    del src, peer, host
    torch.cuda.empty_cache()
    return result


def make_model(root: Path, shape: str, smoke: bool, max_len: int) -> Path:
    """The smoke run's tiny checkpoint, or `shape` with dummy weights (its context widened to
    `max_len` when needed: the published Llama-3-8B config says 8192)."""
    if smoke:
        from splitserve.testing.tiny_model import make_tiny_model

        return make_tiny_model(root / "tiny", "llama")
    path = model_dir(shape, root)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
    (path / "config.json").write_text(json.dumps(config))
    return path


def bench_transport(
    name: str, engine: LLMEngine, d: DecodeSide, hello: dict[str, Any],
    args: argparse.Namespace, ceiling_gbps: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per prompt length, or rows saying why the transport was skipped."""
    reason = hello["skipped"].get(name)
    if reason is None:
        try:
            sender = transport_kind(name).sender(engine.kv_connector, "bench-p")
        except Exception as e:
            reason = f"prefill side: {e!r}"
    if reason is not None:
        return [{"transport": name, "tokens": n, "skipped": reason} for n in args.tokens]
    peer = Peer("bench-d", hello["address"], hello["endpoints"][name])
    rng, rows = random.Random(0), []
    try:
        for tokens in args.tokens:
            prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(tokens)]
            tag, row = f"{name}-{tokens}", {"transport": name, "tokens": tokens}
            rows.append(row)
            try:
                row |= transfer_only(engine, d, sender, peer, prompt, args.repeats, tag)
                row["% of ceil"] = 100 * row["GB/s"] / ceiling_gbps
                if len(rows) == 1:
                    row["first push ms"] = row["warmup_ms"]  # connection setup included
                row |= pipelined(engine, d, sender, peer, prompt, args.repeats, tag)
            except BenchError as e:
                row["skipped"] = f"failed: {e}"
    finally:
        sender.close()
    return rows


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    devices: list[str] = args.devices
    if devices[0].startswith("cuda"):
        torch.cuda.set_device(devices[0])
    max_len = max(args.tokens) + 64
    path = make_model(root, args.shape, args.smoke, max_len)
    ceiling = ceilings(devices)
    config = EngineConfig(
        load_format="safetensors" if args.smoke else "dummy",
        dtype=torch.float32 if args.smoke else torch.bfloat16, device=devices[0],
        enable_cuda_graphs=False, num_kv_blocks=3 * EngineConfig().blocks_for(max_len),
        max_num_batched_tokens=args.chunk, max_model_len=max_len, enable_prefix_caching=False,
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    d_config = dataclasses.replace(config, device=devices[1])
    proc = ctx.Process(
        target=decode_main, args=(child, str(path), d_config, args.transports), daemon=True
    )
    proc.start()
    child.close()  # NOTE: so that D's death reads as end-of-file here
    d = DecodeSide(proc, conn)
    try:
        engine = LLMEngine(path, config)
        hello = d.recv(600)
        gbps = next(iter(ceiling.values()))
        rows = [row for name in args.transports for row in bench_transport(
            name, engine, d, hello, args, gbps)]  # fmt: skip
        stats = {"prefill": dataclasses.asdict(engine.stats()), "decode": d.call("stats")}
    finally:
        if proc.is_alive():
            conn.send(("quit",))
            proc.join(30)
        if proc.is_alive():
            proc.terminate()
    return {
        "benchmark": "kv_transfer", "smoke": args.smoke, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "devices": {"prefill": device_label(devices[0]), "decode": hello["device"]},
        "shape": "tiny llama" if args.smoke else args.shape,
        "dtype": str(config.dtype).removeprefix("torch."), "block_size": config.block_size,
        "block_bytes": engine.kv_connector.region().block_bytes, "chunk_tokens": args.chunk,
        "repeats": args.repeats, "ceilings_GB_per_s": ceiling, "ceiling": next(iter(ceiling)),
        "rows": rows, "engine_stats_after": stats,
    }  # fmt: skip


def git_commit() -> str | None:
    command = ["git", "rev-parse", "--short", "HEAD"]
    try:
        out = subprocess.run(command, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def print_result(result: dict[str, Any]) -> None:
    devices, ceiling = result["devices"], result["ceilings_GB_per_s"]
    print(f"P: {devices['prefill']}  D: {devices['decode']}  {result['shape']} {result['dtype']}")
    print("ceilings: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in ceiling.items()))
    print(f"% of ceil: of {result['ceiling']}\n")
    if result["smoke"]:
        print("smoke run (CPU, tiny model): checks that it runs; not performance numbers")
    done = [r for r in result["rows"] if "skipped" not in r]
    if done:
        print(table(done, COLUMNS))
    for r in result["rows"]:
        if "skipped" in r:
            print(f"{r['transport']} {r['tokens']} tokens: skipped: {r['skipped']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--tokens", type=int, nargs="+", help="prompt lengths")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=TRANSPORTS)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--chunk", type=int, help="prefill chunk (tokens per step)")
    parser.add_argument("--devices", nargs=2, metavar=("PREFILL", "DECODE"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_transfer.json"))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, short prompts")
    args = parser.parse_args(argv)
    for key, full, smoke in DEFAULTS:
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    with tempfile.TemporaryDirectory() as root:
        result = run(args, Path(root))
    print_result(result)
    write_results(args.out, result)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
