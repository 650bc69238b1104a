"""The prefill worker's engine core: the engine and its KV senders, in the core process.

A `prefill` command runs on a thread of its own here: it adds the request, and pushes each batch
of blocks the KV connector reports (pinned) to the decode worker while the engine computes the
next chunk, then answers with the first tokens. The front holds the Redis write lease meanwhile
and says `cancel` when its caller goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from typing import Any

from opentelemetry import context as otel_context

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.errors import Cancelled
from splitserve.engine.kv_connector import KVOutbox
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.kv_transfer.transport import KVSender, Peer
from splitserve.prefill_service.pusher import RequestPusher, Route
from splitserve.protos.v1 import worker_pb2
from splitserve.runtime.engine_core.adapters import adapter_commands
from splitserve.runtime.engine_core.protocol import (
    endpoint_to_wire,
    engine_limits,
    params_from_wire,
)
from splitserve.runtime.engine_core.server import Command, CoreHandler, Emitter
from splitserve.runtime.tracing import Tracing


class PrefillCoreHandler(CoreHandler):
    def __init__(
        self,
        loop: EngineLoop,
        emitter: Emitter,
        senders: dict[str, KVSender],
        tracing: Tracing,
    ) -> None:
        self.loop, self.emitter, self.senders, self.tracing = loop, emitter, senders, tracing
        self._cancels: dict[str, threading.Event] = {}
        self._computed: dict[str, int] = {}  # prefills in progress: prompt tokens computed
        self._lock = threading.Lock()
        loop.add_step_hook(self._progress)

    def info(self) -> dict[str, Any]:
        return {
            **engine_limits(self.loop.engine),
            "kv_transports": list(self.senders),
            "kv_endpoint": endpoint_to_wire(
                {k: v for s in self.senders.values() for k, v in s.endpoint().items()}
            ),
        }

    def commands(self) -> dict[str, Command]:
        return {
            "stats": Command(
                lambda: self.loop.submit(lambda e: dataclasses.asdict(self.loop.stats()))
            ),
            "prefill": Command(self.prefill, waits=True),
            "take_prefix_events": Command(
                lambda: self.loop.submit(lambda e: [list(ev) for ev in e.take_prefix_events()])
            ),
            "cancel": Command(self.cancel),
            **adapter_commands(self.loop),
            "abort": Command(self.abort),
        }

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            event = self._cancels.get(request_id)
        if event is not None:
            event.set()

    def abort(self, request_id: str) -> Any:
        self.cancel(request_id)
        return self.loop.submit(lambda e: bool(e.abort_request(request_id)))

    def _progress(self, engine: LLMEngine) -> None:
        """Engine-thread hook: tell the front how far each prefill in progress got."""
        with self._lock:
            ids = list(self._computed)
        changed = {}
        for request_id in ids:
            computed = engine.num_computed_prompt_tokens(request_id)
            if computed is not None and computed != self._computed.get(request_id):
                changed[request_id] = self._computed[request_id] = computed
        if changed:
            self.emitter.send(["progress", changed])

    def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: bytes,
        priority: int,
        destination: bytes,
        transport: str,
        peer: list[Any],
        carrier: dict[str, str],
        send_timeout_s: float,
    ) -> list[Any]:
        """Prefill into the destination's reserved blocks, pushing them as they complete;
        answers [first tokens' entry, blocks sent, bytes sent] once all are acknowledged."""
        sampling = params_from_wire(params)
        dest = worker_pb2.KVDestination.FromString(destination)
        sender = self.senders.get(transport)
        if sender is None:
            raise Cancelled(f"this worker has no {transport} sender")
        connector = self.loop.engine.kv_connector
        route = Route(sender, Peer(peer[0], peer[1], dict(peer[2])))
        pusher = RequestPusher(request_id, dest, route, connector, send_timeout_s)
        first_block = dest.num_cached_tokens // connector.block_size
        window_from = _window_from(dest, first_block)
        cancel = threading.Event()
        with self._lock:
            self._cancels[request_id] = cancel
            self._computed[request_id] = 0

        def add(engine: LLMEngine) -> KVOutbox:
            engine.add_request(
                list(prompt),
                sampling,
                request_id,
                priority,
                prefill_only=True,
                lora_request=dest.adapter or None,  # the servicer checked it is the request's
            )
            return engine.kv_connector.watch(request_id, first_block, window_from)

        parent = self.tracing.from_carrier(carrier)
        token = otel_context.attach(parent) if parent is not None else None
        outputs = self.loop.subscribe(request_id)
        finished = False
        try:
            outbox = self.loop.call(add)
            output: RequestOutput | None = None
            while output is None or not pusher.done:
                if output is None:
                    # NOTE: once every block is out, wait on the first token itself (published
                    # just after the last batch), not on an outbox that has nothing more.
                    output = _finished_output(outputs, 0.02 if pusher.done else 0.0)
                    if pusher.done:
                        if output is None and cancel.is_set():
                            raise Cancelled(f"prefill of {request_id!r} cancelled by the caller")
                        continue
                try:
                    batch = outbox.get(timeout_s=0.02)
                except queue.Empty:
                    if cancel.is_set():
                        raise Cancelled(
                            f"prefill of {request_id!r} cancelled by the caller"
                        ) from None
                    continue
                pusher.send(batch)
            finished = True
            self.emitter.encoder.forget(request_id)
            entry = self.emitter.encoder.encode([output])[0]
            return [entry, pusher.num_blocks, pusher.num_bytes]
        finally:
            if token is not None:
                otel_context.detach(token)
            with self._lock:
                self._cancels.pop(request_id, None)
                self._computed.pop(request_id, None)
            self.loop.unsubscribe(request_id)
            self.emitter.encoder.forget(request_id)
            connector.unwatch(request_id)  # unpins whatever was not sent (even if stopped)
            if self.loop.running:
                # NOTE: settled before the caller hears back: blocks are free once it does.
                with contextlib.suppress(Exception):
                    self.loop.call(lambda e: _settle(e, request_id, aborted=not finished))


def _window_from(dest: worker_pb2.KVDestination, first_block: int) -> int | None:
    """The first block sent whose window slot goes too: the first the decode worker gave one
    (None: it keeps no window pool)."""
    slots = dest.window_slots
    return next((i for i in range(first_block, len(slots)) if slots[i]), None)


def _settle(engine: LLMEngine, request_id: str, aborted: bool) -> None:
    if aborted:
        engine.abort_request(request_id)
    engine.housekeeping()


def _finished_output(outputs: queue.Queue, timeout_s: float = 0.0) -> RequestOutput | None:
    """The request's final output if it comes within `timeout_s` (raises what ended the
    engine)."""
    while True:
        try:
            item = outputs.get(timeout=timeout_s) if timeout_s > 0 else outputs.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            return item
