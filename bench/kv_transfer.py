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
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from bench.common import SHAPES, median_time, model_dir, table, write_results
from bench.kv_transfer_decode import PARAMS, TIMEOUT_S, blocks_crc, decode_main, device_label
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_connector import KVConnector, KVOutbox
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kv_transfer.transport import KVSender, Peer, Push, TransferError, transport_kind

TRANSPORTS = ["nixl", "grpc"]
DEFAULTS = [  # option, full run, --smoke
    ("tokens", [1024, 4096, 16384], [40, 130]), ("repeats", 5, 2), ("chunk", 2048, 32),
    ("devices", ["cuda:0", "cuda:1"], ["cpu", "cpu"]),
]  # fmt: skip
COLUMNS = [
    "transport", "tokens", "MB", "transfer ms", "GB/s", "% of ceil", "first push ms",
    "exposed ms", "xfer/prefill %", "step ms with", "step ms w/o", "ratio",
]  # fmt: skip


class BenchError(RuntimeError):
    """A measurement that could not complete (a push failed, D did not admit)."""


class DecodeSide:
    """P's handle on D: the process and its pipe."""

    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc, self.conn = proc, conn

    def recv(self, timeout_s: float = TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the decode process did not answer in {timeout_s:g} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the decode process exited (code {self.proc.exitcode})") from None

    def call(self, *message: Any) -> Any:
        self.conn.send(message)
        return self.recv()

    def reserve_and_await(
        self, request_id: str, prompt: list[int], token: int | None, crc: int | None = None
    ) -> tuple[tuple[int, ...], int]:
        """Reserve blocks for `prompt` on D and have D wait for them: (block ids, fence)."""
        blocks, fence = self.call("reserve", request_id, prompt)
        if self.call("await", request_id, token, crc) != "waiting":
            raise RuntimeError("the decode process did not start waiting")
        return tuple(blocks), fence

    def cancel(self, failure: str) -> BenchError:
        """End D's current await (the push failed); returns the error to raise."""
        self.conn.send(("cancel", failure))
        self.recv()
        return BenchError(f"push failed: {failure}")

    def admission(self) -> dict[str, Any]:
        """D's outcome of the current await."""
        out = self.recv()
        if not out["admitted"]:
            raise BenchError(f"decode side did not admit: {out['error']}")
        return out


# -- the prefill side (this process) -------------------------------------------------------------


@dataclasses.dataclass
class Prefill:
    first_token: int
    step_s: list[float]
    start_ns: int
    end_ns: int  # after the last step, its compute stream synchronised


def prefill(engine: LLMEngine, request_id: str, prompt: list[int]) -> Prefill:
    """Prefill `prompt` (prefill_only) one timed engine step at a time (watch it first to send
    its blocks). Only the compute stream is synchronised, not the transports' side streams."""
    device = torch.device(engine.config.device)
    start = time.monotonic_ns()
    engine.add_request(prompt, PARAMS, request_id, prefill_only=True)
    steps: list[float] = []
    while True:
        t = time.perf_counter()
        outputs = engine.step()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        steps.append(time.perf_counter() - t)
        done = [o for o in outputs if o.request_id == request_id and o.finished]
        if done:
            return Prefill(done[0].outputs[0].token_ids[0], steps, start, time.monotonic_ns())


def drain(engine: LLMEngine, request_id: str) -> None:
    """Unpin and forget whatever of a watched request P still holds."""
    engine.housekeeping()
    engine.kv_connector.unwatch(request_id)
    engine.housekeeping()


def transfer_only(
    engine: LLMEngine, d: DecodeSide, sender: KVSender, peer: Peer, prompt: list[int],
    repeats: int, tag: str,
) -> dict[str, Any]:  # fmt: skip
    """All of a prefilled prompt's blocks in one Push: a warm-up, then `repeats` timed ones."""
    request_id = f"{tag}-x"
    outbox = engine.kv_connector.watch(request_id, 0)
    try:
        run = prefill(engine, request_id, prompt)
        batches = [outbox.get(TIMEOUT_S)]
        while not batches[-1].is_last:
            batches.append(outbox.get(TIMEOUT_S))
        src = tuple(b for batch in batches for b in batch.block_ids)
        crc = blocks_crc(engine.kv_connector, src)
        admitted_ms, returned_ms, checks = [], [], []
        for i in range(repeats + 1):
            dst_id = f"{request_id}{i}"
            check = crc if i == 0 else None
            dst, fence = d.reserve_and_await(dst_id, prompt, run.first_token, check)
            push = Push(dst_id, fence, src, dst, len(prompt), batches[-1])
            start = time.monotonic_ns()
            try:
                sender.push(peer, push, TIMEOUT_S)
            except TransferError as e:
                raise d.cancel(str(e)) from e
            returned_ms.append((time.monotonic_ns() - start) / 1e6)
            out = d.admission()
            admitted_ms.append((out["admitted_ns"] - start) / 1e6)
            checks.append(out["checksum_ok"])
    finally:
        drain(engine, request_id)
    num_bytes = len(src) * engine.kv_connector.region().block_bytes
    transfer_ms = statistics.median(admitted_ms[1:])
    return {
        "num_blocks": len(src), "bytes": num_bytes, "MB": num_bytes / 1e6,
        "warmup_ms": admitted_ms[0], "transfer_ms_all": admitted_ms[1:],
        "transfer ms": transfer_ms, "GB/s": num_bytes / transfer_ms / 1e6,
        "push_returned_ms_all": returned_ms[1:], "checksum_ok": checks[0],
        "admitted": len(admitted_ms), "requests": repeats + 1,
    }  # fmt: skip


def push_batches(
    outbox: KVOutbox, sender: KVSender, peer: Peer, connector: KVConnector, fence: int,
    dst: tuple[int, ...], log: list[tuple[int, int, int]], errors: list[BaseException],
) -> None:  # fmt: skip
    """The service's sender thread: push each batch as it is reported, then release it."""
    try:
        while True:
            batch = outbox.get(TIMEOUT_S)
            if batch.block_ids:
                end = batch.first_index + len(batch.block_ids)
                push = Push(
                    outbox.request_id, fence, batch.block_ids, dst[batch.first_index : end],
                    batch.num_tokens, batch,
                )  # fmt: skip
                start = time.monotonic_ns()
                sender.push(peer, push, TIMEOUT_S)
                log.append((start, time.monotonic_ns(), len(batch.block_ids)))
                connector.release(outbox.request_id, batch.block_ids)
            if batch.is_last:
                return
    except BaseException as e:
        errors.append(e)


def pipelined(
    engine: LLMEngine, d: DecodeSide, sender: KVSender, peer: Peer, prompt: list[int],
    repeats: int, tag: str,
) -> dict[str, Any]:  # fmt: skip
    """Prefill with pushes in flight, each run after the same prompt prefilled unwatched."""
    with_s, without_s, prefill_ms, exposed_ms, landed_ms, pushes = [], [], [], [], [], []
    for i in range(repeats):
        without_s += prefill(engine, f"{tag}-base{i}", prompt).step_s
        request_id = f"{tag}-pipe{i}"
        dst, fence = d.reserve_and_await(request_id, prompt, None)
        outbox = engine.kv_connector.watch(request_id, 0)
        log: list[tuple[int, int, int]] = []
        errors: list[BaseException] = []
        args = (outbox, sender, peer, engine.kv_connector, fence, dst, log, errors)
        thread = threading.Thread(target=push_batches, args=args, daemon=True)
        thread.start()
        try:
            run = prefill(engine, request_id, prompt)
            d.conn.send(("token", run.first_token))
            thread.join(TIMEOUT_S)
            if errors or thread.is_alive():
                raise d.cancel(repr(errors[0]) if errors else "the sender thread hung")
            out = d.admission()
        finally:
            drain(engine, request_id)
        with_s += run.step_s
        prefill_ms.append((run.end_ns - run.start_ns) / 1e6)
        exposed_ms.append((out["admitted_ns"] - run.end_ns) / 1e6)
        landed_ms.append((out["complete_ns"] - run.end_ns) / 1e6)
        pushes.append([((s - run.start_ns) / 1e6, (e - s) / 1e6, n) for s, e, n in log])
    with_ms, without_ms = statistics.median(with_s) * 1e3, statistics.median(without_s) * 1e3
    shares = [e / p for e, p in zip(exposed_ms, prefill_ms, strict=True)]
    return {
        "prefill ms": statistics.median(prefill_ms), "exposed ms": statistics.median(exposed_ms),
        "xfer/prefill %": 100 * statistics.median(shares),
        "step ms with": with_ms, "step ms w/o": without_ms, "ratio": with_ms / without_ms,
        "prefill_ms_all": prefill_ms, "exposed_ms_all": exposed_ms,
        "last_landed_ms_all": landed_ms,  # D had every block, after P's last step
        "step_ms_with_all": [s * 1e3 for s in with_s],
        "step_ms_without_all": [s * 1e3 for s in without_s],
        "pushes": pushes,  # per run, per push: start ms after prefill start, ms, blocks
        "pipelined_admitted": len(exposed_ms), "pipelined_requests": repeats,
    }  # fmt: skip


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
