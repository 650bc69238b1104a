"""The decode worker's engine core: the engine, its KV pool's receivers and the reservations
they land in, in the core process. The front (`DecodeWorker`) reaches them only through the
commands below; Redis, gRPC streams and text stay in the front.

    Reserve:  front ── reserve ──▶ engine holds blocks ── Redis record (front) ──▶ open_landing
    pushes:   prefill worker ──▶ receiver (here) ──▶ ReservationBook.landed / hold
    Decode:   front ── wait_landed ──▶ ... ── admit ──▶ tokens, one step message at a time
"""

from __future__ import annotations

import dataclasses
from typing import Any

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import Resume
from splitserve.kv_transfer.transport import KVReceiver
from splitserve.runtime.engine_core.adapters import adapter_commands
from splitserve.runtime.engine_core.protocol import (
    endpoint_to_wire,
    engine_limits,
    first_tokens_from_wire,
    params_from_wire,
)
from splitserve.runtime.engine_core.server import Command, CoreHandler, Emitter


class DecodeCoreHandler(CoreHandler):
    def __init__(
        self,
        loop: EngineLoop,
        emitter: Emitter,
        book: ReservationBook,
        receivers: list[KVReceiver],
        offered: tuple[str, ...],
    ) -> None:
        self.loop, self.emitter, self.book = loop, emitter, book
        self.receivers, self.offered = receivers, offered

    def info(self) -> dict[str, Any]:
        return {
            **engine_limits(self.loop.engine),
            "kv_transports": list(self.offered),
            "kv_endpoint": endpoint_to_wire(
                {k: v for r in self.receivers for k, v in r.endpoint().items()}
            ),
        }

    def commands(self) -> dict[str, Command]:
        return {
            "stats": Command(self.stats),
            "reserve": Command(self.reserve),
            **adapter_commands(self.loop),
            "open_landing": Command(self.open_landing),
            "wait_landed": Command(self.wait_landed, waits=True),
            "admit": Command(self.admit),
            "park": Command(self.park),
            "abort": Command(self.abort, waits=True),
            "take_prefix_events": Command(self.take_prefix_events),
        }

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()

    def stats(self) -> Any:
        return self.loop.submit(lambda e: dataclasses.asdict(self.loop.stats()))

    def reserve(
        self,
        request_id: str,
        prompt: list[int],
        params: bytes,
        resume: list[Any] | None,
        adapter: str | None = None,
    ) -> Any:
        sampling = params_from_wire(params)
        resumed = None if resume is None else Resume(resume[0], tuple(resume[1]))

        def run(e: LLMEngine) -> list[Any]:
            res = e.reserve(request_id, list(prompt), sampling, resumed, lora_name=adapter)
            return [list(res.block_ids), res.num_cached_tokens, list(res.window_slots)]

        return self.loop.submit(run)

    def open_landing(
        self,
        request_id: str,
        fence: int,
        block_ids: list[int],
        num_cached_tokens: int,
        capability: bytes,
        window_slots: list[int] | None = None,
    ) -> None:
        """Pushes for `request_id` under `fence` may land now (with `capability`), into its
        blocks and the window slots the reservation gave them."""
        self.book.add(
            LocalReservation(
                request_id=request_id,
                fence=fence,
                block_ids=tuple(block_ids),
                num_cached_tokens=num_cached_tokens,
                block_size=self.loop.engine.config.block_size,
                capability=capability,
                window_slots=tuple(window_slots or ()),
            )
        )

    def wait_landed(
        self, request_id: str, timeout_s: float, num_kv_tokens: int | None = None
    ) -> list[Any]:
        """Until every needed block landed: [ok, why not, progress, bytes, blocks]; a complete
        reservation is closed (later pushes are refused) before the answer. `num_kv_tokens`:
        only the blocks of that many leading tokens are needed (a hand-off)."""
        res = self.book.get(request_id)
        if res is None:
            return [False, "reclaimed", "0 blocks", 0, 0]
        if num_kv_tokens is not None:
            with res.changed:
                res.num_kv_tokens = num_kv_tokens
                res.notify()
        ok = res.wait_complete(timeout_s)
        why = res.refusal or ("reclaimed" if res.dead else "timed out")
        if ok:
            self.book.pop(request_id)
        return [ok, "" if ok else why, res.progress(), res.num_bytes, len(res.received)]

    def admit(
        self,
        request_id: str,
        params: bytes,
        first_tokens: list[Any],
        priority: int,
        kv_present: bool = False,
    ) -> Any:
        sampling = params_from_wire(params)
        tokens = first_tokens_from_wire(first_tokens)
        # NOTE: its landing closes first: nothing writes into blocks the engine computes (a
        # hand-off that failed part way, then recomputed here).
        self.book.pop(request_id)

        def run(e: LLMEngine) -> None:
            # NOTE: published on the engine thread, so its message precedes the reply and any
            # later step's.
            self.loop.publish(e.admit(request_id, sampling, tokens, priority, kv_present))

        return self.loop.submit(run)

    def park(self, request_id: str) -> Any:
        """Keep a running request's KV for a hand-off: the tokens it covers, or None when it
        has none to keep (engine/parking.py)."""

        def run(e: LLMEngine) -> int | None:
            parked = e.park(request_id)
            if parked is None:
                return None
            self.emitter.encoder.forget(request_id)  # NOTE: no more outputs for it
            return parked.num_tokens

        return self.loop.submit(run)

    def abort(self, request_id: str) -> list[bool]:
        """[engine had it, a reservation was open]. NOTE: closing the reservation waits for a
        KV write into its blocks to end, so it runs on a thread of its own."""
        res = self.book.pop(request_id)
        aborted = False
        if self.loop.running:
            aborted = bool(self.loop.call(lambda e: e.abort_request(request_id)))
        self.emitter.encoder.forget(request_id)
        return [aborted, res is not None]

    def take_prefix_events(self) -> Any:
        return self.loop.submit(lambda e: [list(ev) for ev in e.take_prefix_events()])
