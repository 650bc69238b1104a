"""The engine core of a worker started with `--role-switch`: one engine, one KV pool, with both
roles' commands, so the worker can change role without reloading anything.

    front ── reserve / open_landing / wait_landed / admit ──▶ decode commands ─┐
    front ── prefill / cancel ──────────────────────────────▶ prefill commands ├─▶ one EngineLoop
    prefill workers ──▶ KV receivers (landing in the reservations) ─────────────┘
    KV senders ──▶ decode workers (this worker's prefills, and the KV of streams it moved off
                   while changing role: `hand_off`, `splitserve/roles/handoff_core.py`)

Which role it serves in is the front's business (`splitserve/roles/switch.py`): the core answers
whatever it is sent, so work of the old role in flight finishes while the new one starts.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from splitserve.decode_service.core import DecodeCoreHandler
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.outputs import RequestOutput
from splitserve.launch.core_build import (
    core_tracing,
    decode_handler,
    prefill_handler,
    report_failure,
)
from splitserve.launch.engine_core import CoreSpec
from splitserve.launch.workers import build_engine
from splitserve.prefill_service.core import PrefillCoreHandler
from splitserve.roles.handoff_core import hand_off
from splitserve.runtime.engine_core.protocol import endpoint_to_wire
from splitserve.runtime.engine_core.server import Command, CoreHandler, Emitter


class PrefillFilter:
    """The loop's sink: a step's outputs to the front, but not those of prefills (their first
    tokens go back as the `prefill` command's reply; the step stream must not encode them at
    the same time)."""

    def __init__(self, emitter: Emitter) -> None:
        self.emitter = emitter
        self.prefilling: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            kept = [o for o in outputs if o.request_id not in self.prefilling]
        if kept:
            self.emitter.outputs(kept)

    def hold(self, request_id: str) -> None:
        with self._lock:
            self.prefilling.add(request_id)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self.prefilling.discard(request_id)


class SwitchableCoreHandler(CoreHandler):
    """Both roles' commands on one engine; `abort` ends whichever the request is in."""

    def __init__(
        self,
        loop: EngineLoop,
        decode: DecodeCoreHandler,
        prefill: PrefillCoreHandler,
        sink: PrefillFilter,
    ) -> None:
        self.loop, self.decode, self.prefill, self.sink = loop, decode, prefill, sink

    def info(self) -> dict[str, Any]:
        decode, prefill = self.decode.info(), self.prefill.info()
        endpoint = {k: v for r in self.decode.receivers for k, v in r.endpoint().items()}
        endpoint.update(
            {k: v for s in self.prefill.senders.values() for k, v in s.endpoint().items()}
        )
        return {
            **decode,
            "kv_transports": decode["kv_transports"],  # what it receives with
            "send_transports": prefill["kv_transports"],  # what it pushes with
            "kv_endpoint": endpoint_to_wire(endpoint),
        }

    def commands(self) -> dict[str, Command]:
        return {
            **self.prefill.commands(),
            **self.decode.commands(),
            "prefill": Command(self.run_prefill, waits=True),
            "abort": Command(self.abort, waits=True),
            "hand_off": Command(
                functools.partial(hand_off, self.loop, self.prefill.senders), waits=True
            ),
        }

    def run_prefill(self, request_id: str, *args: Any) -> list[Any]:
        self.sink.hold(request_id)
        try:
            return self.prefill.prefill(request_id, *args)
        finally:
            self.sink.drop(request_id)

    def abort(self, request_id: str) -> list[bool]:
        """[engine had it, a reservation was open] (a prefill is cancelled too)."""
        self.prefill.cancel(request_id)
        return self.decode.abort(request_id)

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def build_switchable(spec: CoreSpec, emitter: Emitter) -> tuple[EngineLoop, CoreHandler]:
    """The loop and handler of a `--role-switch` core: KV senders and receivers both."""
    tracing = core_tracing(spec)
    failed = report_failure(emitter)
    engine = build_engine(spec.service, spec.worker, record_prefix_events=True)
    sink = PrefillFilter(emitter)
    loop = EngineLoop(engine, sink=sink, on_failure=failed).start()
    prefill = prefill_handler(loop, emitter, spec, tracing)
    decode = decode_handler(loop, emitter, spec, tracing)
    return loop, SwitchableCoreHandler(loop, decode, prefill, sink)
