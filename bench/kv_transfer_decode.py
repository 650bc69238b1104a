"""The decode side of bench/kv_transfer.py: a separate process with its own engine, both
transports' receivers over a `ReservationBook`, and a control pipe (reserve a prompt, wait for
a request's admission) to the prefill side."""

from __future__ import annotations

import dataclasses
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import SampledToken
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv_transfer.transport import transport_kind
from splitserve.kv_transfer.wire import CacheLayout, as_blocks, crc32c

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
TIMEOUT_S = 120.0


def blocks_crc(connector: KVConnector, block_ids: tuple[int, ...]) -> int:
    """CRC-32C of these blocks as they sit in the pool (the gRPC wire payload's bytes)."""
    layout = CacheLayout.of(connector.region())
    buf = torch.empty(layout.payload_bytes(len(block_ids)), dtype=torch.uint8)
    connector.read_blocks(block_ids, as_blocks(buf, layout))
    return crc32c(buf.numpy())


def device_label(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


# -- the decode side (a spawned process) ---------------------------------------------------------


def decode_main(conn: Connection, model_path: str, config: EngineConfig, names: list[str]) -> None:
    """D: an engine, the receivers of `names`, then `serve` until told to quit."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(config.device)
    engine = LLMEngine(model_path, config)
    book, receivers = ReservationBook(), []
    endpoints: dict[str, dict[str, bytes]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            receivers.append(transport_kind(name).receiver(engine.kv_connector, book, "bench-d"))
            endpoints[name] = receivers[-1].endpoint()
        except Exception as e:
            skipped[name] = f"decode side: {e!r}"
    hello = {"address": "unused:0", "endpoints": endpoints, "skipped": skipped}
    conn.send(hello | {"device": device_label(config.device)})
    try:
        serve(conn, engine, book)
    finally:
        for receiver in receivers:
            receiver.close()


def serve(conn: Connection, engine: LLMEngine, book: ReservationBook) -> None:
    """Commands: ("reserve", id, prompt) -> (block ids, fence); ("await", id, first token or
    None, CRC-32C or None) -> "waiting", then `await_admission`'s outcome; ("stats",); ("quit",).
    """
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        if cmd == "quit":
            return
        if cmd == "reserve":
            request_id, prompt = args
            blocks = engine.reserve(request_id, prompt, PARAMS).block_ids
            book.add(LocalReservation(request_id, 1, blocks, 0, engine.config.block_size))
            conn.send((blocks, 1))
        elif cmd == "await":
            conn.send(await_admission(conn, engine, book, *args))
        elif cmd == "stats":
            conn.send(dataclasses.asdict(engine.stats()) | {"num_reservations": len(book)})
        # anything else is a late "token" / "cancel" for an await that already ended


def await_admission(
    conn: Connection, engine: LLMEngine, book: ReservationBook, request_id: str,
    token: int | None, expected_crc: int | None,
) -> dict[str, Any]:  # fmt: skip
    """Once every block of `request_id` landed and its first token is known (given, or sent
    later as ("token", id)), admit it; then check the blocks' CRC-32C (if given) and free it.
    ("cancel", why) ends the wait."""
    res = book.get(request_id)
    assert res is not None, f"no reservation {request_id!r}"
    conn.send("waiting")
    deadline, complete_ns = time.monotonic() + TIMEOUT_S, 0
    try:
        while not complete_ns or token is None:
            if not complete_ns and res.wait_complete(0.01):
                complete_ns = time.monotonic_ns()
                continue
            if res.refusal or res.dead or time.monotonic() > deadline:
                return {"admitted": False, "error": res.refusal or f"got {res.progress()}"}
            if conn.poll(0.01 if complete_ns else 0):
                kind, value = conn.recv()
                if kind == "cancel":
                    return {"admitted": False, "error": f"cancelled: {value}"}
                token = value
        engine.admit(request_id, PARAMS, [SampledToken(token)])
        admitted_ns = time.monotonic_ns()
        same = None if expected_crc is None else blocks_crc(engine.kv_connector, res.block_ids)
        return {
            "admitted": True, "complete_ns": complete_ns, "admitted_ns": admitted_ns,
            "num_bytes": res.num_bytes,
            "checksum_ok": None if same is None else same == expected_crc,
        }  # fmt: skip
    finally:
        book.pop(request_id)
        engine.abort_request(request_id)
