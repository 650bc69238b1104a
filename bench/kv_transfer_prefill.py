"""The prefill side of the KV transfer benchmark (`bench/kv_transfer.py`), in the benchmark's
own process: P's handle on the decode process D, a timed prefill, and the two measurements —
all of a prompt's blocks in one push (`transfer_only`) and pushes in flight while P prefills in
chunks (`pipelined`). D's side is `bench/kv_transfer_decode.py`.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.kv_transfer_decode import PARAMS, TIMEOUT_S, blocks_crc
from splitserve.engine.kv_connector import KVConnector, KVOutbox
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kv_transfer.transport import KVSender, Peer, Push, TransferError


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
