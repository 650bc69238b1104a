"""The decode side of NIXL (see nixl_transport.py): exposes the pool to NIXL writers and lands
their pushes as notifications arrive, from the senders members vouch for (nixl_vetting.py)."""

from __future__ import annotations

import json
import logging
import threading

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.nixl_transport import SENDER_FIELD, NixlAgent, page_text
from splitserve.kv_transfer.nixl_vetting import VouchedSenders, label
from splitserve.kv_transfer.registry_conceal import Concealed
from splitserve.kv_transfer.transport import (
    KVReceiver,
    Landing,
    PushObserver,
    PushRefused,
    ReceiverBind,
)

log = logging.getLogger(__name__)

MAX_LOGGED_BYTES = 200  # of a malformed notification
IDLE_POLL_S = 0.0005  # sleep between empty notification polls
_MAX_WARNED = 4096  # requests remembered for the once-per-request refusal warning


class NixlReceiver(KVReceiver):
    """Exposes this worker's pool to NIXL writers and lands their pushes as notifications
    arrive (a daemon thread). With `bind.vouch`, only notifications from senders that live
    members vouch for are read at all. Counters: `num_pushes`, `num_refused`, `num_bytes`,
    `num_malformed`, `num_unvouched`."""

    name = "nixl"

    def __init__(
        self,
        connector: KVConnector,
        landing: Landing,
        worker_id: str,
        tracer: trace.Tracer | None = None,
        on_push: PushObserver | None = None,
        bind: ReceiverBind | None = None,  # NOTE: only its `vouch`: UCX picks its own sockets
    ) -> None:
        vouch = bind.vouch if bind is not None else None
        self._vetting = None if vouch is None else VouchedSenders(lambda: vouch(SENDER_FIELD))
        self._nixl = NixlAgent(connector, worker_id)
        self._landing = landing
        self._tracer = tracer
        self._on_push = on_push
        try:  # NOTE: read after registering: the metadata carries the pool's remote keys
            self._metadata: bytes = self._nixl.agent.get_agent_metadata()
        except Exception as e:
            self._nixl.deregister()
            raise RuntimeError(f"NIXL agent {self._nixl.name!r}: no metadata: {e}") from e
        self.num_pushes = self.num_refused = self.num_bytes = self.num_malformed = 0
        self._warned: set[str] = set()  # requests warned about (refusals), bounded
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"nixl-recv-{self._nixl.name}", daemon=True
        )
        self._thread.start()

    def endpoint(self) -> dict[str, bytes]:
        """What a `NixlSender` needs: agent name and metadata, and the pool's block layout."""
        region, nixl = self._nixl.region, self._nixl
        fields = {
            "agent": nixl.name, "base": region.base_address, "block_bytes": region.block_bytes,
            "num_blocks": region.num_blocks, "device": nixl.device_id, "mem_type": nixl.mem_type,
        }  # fmt: skip
        if region.window is not None:  # NOTE: the sliding layers' slots, after the blocks
            w = region.window
            fields.update(window_base=w.base_address, slot_bytes=w.slot_bytes,
                          num_slots=w.num_slots)  # fmt: skip
        out = {f"nixl.{k}": str(v).encode("ascii") for k, v in fields.items()}
        out["nixl.page"] = page_text(region).encode("ascii")  # what a block holds
        # NOTE: concealed at rest: whoever loads the metadata can write into the pool.
        out["nixl.metadata"] = Concealed(self._metadata)
        return out

    @property
    def num_unvouched(self) -> int:
        """Notifications dropped: their sender's agent is not vouched for by a live member."""
        return self._vetting.num_unvouched if self._vetting is not None else 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notifs = self._nixl.agent.get_new_notifs()
            except Exception:
                log.exception("NIXL receiver %s: polling notifications failed", self._nixl.name)
                notifs = {}
            ready = [(str(s), m) for s, messages in notifs.items() for m in messages]
            if self._vetting is not None:
                ready = [(s, m) for s, m in ready if self._vetting.check(s, m)]
                ready += self._vetting.release()  # held ones, once a registry read vouches
            if not notifs:
                self._stop.wait(IDLE_POLL_S)
            for sender, message in ready:
                try:
                    self._handle(sender, message)
                except Exception:
                    log.exception("NIXL receiver: handling a notification from %s", label(sender))

    def _handle(self, sender: str, message: bytes) -> None:
        try:
            note = json.loads(message)
            request_id, fence = str(note["r"]), int(note["f"])
            dst, num_bytes = [int(b) for b in note["d"]], int(note["b"])
            slots = [int(s) for s in note.get("w", ())]
            traceparent = str(note.get("t", ""))
            capability = bytes.fromhex(str(note.get("c", "")))
        except (ValueError, KeyError, TypeError) as e:
            self.num_malformed += 1
            log.warning(
                "NIXL receiver: malformed notification from %s (%r): %r",
                label(sender), e, message[:MAX_LOGGED_BYTES],
            )  # fmt: skip
            return
        span = self._span(traceparent, request_id, num_bytes, len(dst))
        try:
            allowed = self._landing.allowed_blocks(request_id, fence)
            self._landing.check_capability(request_id, capability)
            outside = [b for b in dst if b not in allowed]
            if outside:
                raise PushRefused(
                    "FAILED_PRECONDITION",
                    f"blocks {outside[:8]} are outside the reservation (fence {fence})",
                )
            if self._nixl.region.window is not None:
                self._landing.check_window(request_id, fence, dst, slots)
            elif slots:
                raise PushRefused("FAILED_PRECONDITION", "window slots for a pool with none")
            self._landing.landed(request_id, fence, dst, num_bytes)
        except PushRefused as e:
            span.set_status(Status(StatusCode.ERROR, f"{e.status}: {e}"))
            span.end()
            self._refuse(sender, request_id, fence, dst, f"{e.status}: {e}")
            if self._on_push is not None:
                self._on_push(0, None, False)
            return
        span.end()
        self.num_pushes += 1
        self.num_bytes += num_bytes
        if self._on_push is not None:
            self._on_push(num_bytes, None, True)  # one-sided: the receiver can't time it

    def _span(self, traceparent: str, request_id: str, num_bytes: int, num_blocks: int) -> Span:
        """A `kv.receive` span under the sender's `kv.push` (its context rode the notification)."""
        if self._tracer is None or not traceparent:
            return trace.INVALID_SPAN
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        return self._tracer.start_span(
            "kv.receive",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "splitserve.request_id": request_id,
                "splitserve.kv.bytes": num_bytes,
                "splitserve.kv.num_blocks": num_blocks,
                "splitserve.kv.transport": "nixl",
            },
        )

    def _refuse(
        self, sender: str, request_id: str, fence: int, dst: list[int], reason: str
    ) -> None:
        self.num_refused += 1
        if not self._landing.refused(request_id, fence, dst, reason):
            reason += "; the live reservation is left to its writer"
        if request_id not in self._warned:
            if len(self._warned) >= _MAX_WARNED:
                self._warned.clear()
            self._warned.add(request_id)
            log.warning("NIXL push from %s for %r refused: %s", label(sender), request_id, reason)

    def close(self) -> None:
        """Stop the notification thread and deregister the pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()
        self._nixl.deregister()
