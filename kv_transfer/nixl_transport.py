"""KV transfer over NIXL: one-sided WRITEs straight from pool to pool, then a notification.

    prefill worker (NixlSender)                        decode worker (NixlReceiver)
    pool ─ registered once, one prepped                pool ─ registered once; endpoint():
           descriptor per block                               agent name, metadata, base,
                │                                             block_bytes, num_blocks, device
    push: make_prepped_xfer(WRITE,                            │  (published in the registry)
          src ids ──────── bytes (UCX) ─────────────▶  dst blocks (no receiver CPU involved)
          notif) ───────── notification ───────────▶  poller thread: JSON {r, f, d, n, b}
    poll check_xfer_state until DONE                   Landing.allowed_blocks (fence) ─▶ landed
                                                       or Landing.refused (request fails)

The sender loads each peer's metadata and preps its remote block list once (keyed by the remote
agent name, so a restarted peer, which publishes a new name, gets a new entry). NIXL merges
adjacent descriptors of one transfer into one copy.

NOTE: the write is one-sided: the receiver checks the reservation only after the bytes are in
its pool. A refused notification (stale fence, unknown request, blocks outside the reservation)
fails the request on the decode side; it cannot un-write the bytes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.engine.kv_connector import KVConnector, KVRegion
from splitserve.kv_transfer.transport import (
    KVReceiver,
    KVSender,
    Landing,
    Peer,
    Push,
    PushObserver,
    PushRefused,
    PushResult,
    ReceiverBind,
    TransferError,
)

log = logging.getLogger(__name__)

MAX_LOGGED_BYTES = 200  # of a malformed notification
IDLE_POLL_S = 0.0005  # receiver: sleep between empty notification polls
SPIN_S, POLL_S = 0.001, 0.0001  # sender: yield-only polling first, then short sleeps
_MAX_WARNED = 4096  # requests remembered for the once-per-request refusal warning


def _blocks(
    base: int, block_bytes: int, num_blocks: int, device: int
) -> list[tuple[int, int, int]]:
    """One (address, length, device) descriptor per block."""
    return [(base + b * block_bytes, block_bytes, device) for b in range(num_blocks)]


class _Agent:
    """A NIXL agent (UCX backend) with the connector's whole pool registered once."""

    def __init__(self, connector: KVConnector, worker_id: str) -> None:
        try:
            from nixl_cu13 import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(f"NIXL transport unavailable: cannot import nixl_cu13 ({e})") from e
        self.region: KVRegion = connector.region()
        device = self.region.device
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.device_id = (device.index or 0) if device.type == "cuda" else 0
        self.name = f"{worker_id}-{uuid.uuid4().hex[:8]}"
        size = self.region.num_blocks * self.region.block_bytes
        try:
            # NOTE: no progress thread: the Python API runs it with a 0 us delay, so it spins a
            # whole core per agent. Transfers progress when the sender polls check_xfer_state
            # and the receiver polls get_new_notifs, which is enough for UCX (shm and TCP).
            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.agent = nixl_agent(self.name, config)
            if "UCX" not in self.agent.backends:
                raise RuntimeError("the UCX backend plugin is missing")
            pool = [(self.region.base_address, size, self.device_id, "")]
            self.registered: Any = self.agent.register_memory(pool, self.mem_type)
        except Exception as e:
            raise RuntimeError(f"cannot create NIXL agent {self.name!r}: {e}") from e

    def deregister(self) -> None:
        try:
            self.agent.deregister_memory(self.registered)
        except Exception:
            log.exception("NIXL agent %s: deregistering the KV pool failed", self.name)


@dataclass
class _RemotePeer:
    name: str  # the remote agent's name (the cache key)
    blocks: Any  # its prepped descriptor list, one per block
    num_blocks: int


class NixlSender(KVSender):
    """Writes blocks into peers' pools with NIXL. Thread-safe: one lock serialises agent calls,
    each short; a push polls its transfer without holding the lock in between."""

    name = "nixl"

    def __init__(self, connector: KVConnector, worker_id: str) -> None:
        self._nixl = _Agent(connector, worker_id)
        region = self._nixl.region
        self._block_bytes = region.block_bytes
        self._num_blocks = region.num_blocks
        self._lock = threading.Lock()
        self._peers: dict[str, _RemotePeer] = {}
        self._closed = False
        try:
            self._local = self._nixl.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                _blocks(region.base_address, region.block_bytes, region.num_blocks,
                        self._nixl.device_id),
                self._nixl.mem_type,
            )  # fmt: skip
        except Exception as e:
            self._nixl.deregister()
            raise RuntimeError(f"NIXL agent {self._nixl.name!r}: cannot prep the pool: {e}") from e

    def push(self, peer: Peer, push: Push, timeout_s: float) -> PushResult:
        """Write the source blocks into the peer's destination blocks and notify it; returns once
        the write is complete (the peer then checks the fence and records the blocks)."""
        deadline = time.monotonic() + timeout_s
        if push.ready is not None:
            push.ready.wait()  # NOTE: before reading the source blocks: their writes may be queued
        src, dst = list(push.src_block_ids), list(push.dst_block_ids)
        num_bytes = len(src) * self._block_bytes
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)  # nothing unless a span is recording
        notif = json.dumps(
            {"r": push.request_id, "f": push.fence, "d": dst, "n": push.num_tokens,
             "b": num_bytes, "t": carrier.get("traceparent", ""), "c": push.capability.hex()},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        agent = self._nixl.agent
        remote: _RemotePeer | None = None
        handle = None
        try:
            with self._lock:
                # NOTE: peer lookup and make_prepped_xfer under one lock hold, so that a peer
                # dropped by another thread never has its released list used here.
                remote = self._remote(peer)
                if not src:  # nothing to write: the notification alone carries the progress
                    agent.send_notif(remote.name, notif)
                    return PushResult(0, 0)
                for ids, limit in ((src, self._num_blocks), (dst, remote.num_blocks)):
                    if not all(0 <= i < limit for i in ids):
                        raise TransferError(
                            f"block ids {ids} not in [0, {limit})", "INVALID_ARGUMENT"
                        )
                handle = agent.make_prepped_xfer(
                    "WRITE", self._local, src, remote.blocks, dst, notif
                )
                state = agent.transfer(handle)
            what = f"NIXL write of {len(src)} blocks to {peer.worker_id}"
            self._wait(handle, state, deadline, timeout_s, what)
        except TransferError as e:
            if e.status == "UNAVAILABLE" and remote is not None:
                self._drop(remote)
            raise
        except Exception as e:  # a NIXL error, e.g. nixlRemoteDisconnectError: the peer died
            if remote is not None:
                self._drop(remote)
            raise TransferError(f"NIXL push to {peer.worker_id} failed: {e!r}") from e
        finally:
            if handle is not None:
                try:
                    with self._lock:
                        handle.release()
                except Exception as e:  # still in flight (timeout) and not cancellable
                    log.warning("NIXL: releasing a transfer handle failed: %r", e)
        return PushResult(num_blocks=len(src), num_bytes=num_bytes)

    def _wait(self, handle: Any, state: str, deadline: float, timeout_s: float, what: str) -> None:
        """Poll the transfer until DONE, yielding the CPU; TransferError on ERR or timeout."""
        started = time.monotonic()
        while state == "PROC":
            now = time.monotonic()
            if now > deadline:
                raise TransferError(f"{what} did not complete within {timeout_s:g} s")
            time.sleep(0 if now - started < SPIN_S else POLL_S)
            with self._lock:
                state = self._nixl.agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"{what} failed (NIXL transfer state {state})")

    def _remote(self, peer: Peer) -> _RemotePeer:
        """The peer's cached prepped block list, set up on first use (holding the lock)."""
        if self._closed:
            raise TransferError("the NIXL sender is closed")
        ep = peer.endpoint
        try:
            name = ep["nixl.agent"].decode()
            cached = self._peers.get(name)
            if cached is not None:
                return cached
            block_bytes, num_blocks = int(ep["nixl.block_bytes"]), int(ep["nixl.num_blocks"])
            base, device = int(ep["nixl.base"]), int(ep["nixl.device"])
            mem_type, metadata = ep["nixl.mem_type"].decode(), ep["nixl.metadata"]
        except (KeyError, ValueError) as e:
            raise TransferError(
                f"peer {peer.worker_id} publishes no usable NIXL endpoint ({e!r})",
                "FAILED_PRECONDITION",
            ) from e
        if block_bytes != self._block_bytes:
            raise TransferError(
                f"peer {peer.worker_id} has {block_bytes}-byte KV blocks, this worker "
                f"{self._block_bytes}-byte ones (different model, dtype or block size)",
                "FAILED_PRECONDITION",
            )
        agent = self._nixl.agent
        agent.add_remote_agent(metadata)  # NOTE: connects (UCX endpoint) while holding the lock
        try:
            blocks = agent.prep_xfer_dlist(
                name, _blocks(base, block_bytes, num_blocks, device), mem_type
            )
        except Exception:
            agent.remove_remote_agent(name)
            raise
        remote = self._peers[name] = _RemotePeer(name, blocks, num_blocks)
        return remote

    def _drop(self, remote: _RemotePeer) -> None:
        """Forget a failed peer (it may be dead): the next push loads its metadata again."""
        with self._lock:
            if self._peers.get(remote.name) is not remote:
                return  # dropped already (or closed)
            del self._peers[remote.name]
            self._forget(remote)

    def _forget(self, remote: _RemotePeer) -> None:  # holding the lock
        try:
            remote.blocks.release()
            self._nixl.agent.remove_remote_agent(remote.name)  # disconnects
        except Exception as e:
            log.warning("NIXL: forgetting peer agent %s failed: %r", remote.name, e)

    def close(self) -> None:
        """Release the prepped lists, forget the peers and deregister the pool (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for remote in self._peers.values():
                self._forget(remote)
            self._peers.clear()
            self._local.release()
            self._nixl.deregister()


class NixlReceiver(KVReceiver):
    """Exposes this worker's pool to NIXL writers and lands their pushes as notifications
    arrive (a daemon thread). Counters: `num_pushes`, `num_refused`, `num_bytes`,
    `num_malformed`."""

    name = "nixl"

    def __init__(
        self,
        connector: KVConnector,
        landing: Landing,
        worker_id: str,
        tracer: trace.Tracer | None = None,
        on_push: PushObserver | None = None,
        bind: ReceiverBind | None = None,  # NOTE: unused: UCX picks its own sockets
    ) -> None:
        self._nixl = _Agent(connector, worker_id)
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
        out = {f"nixl.{k}": str(v).encode("ascii") for k, v in fields.items()}
        out["nixl.metadata"] = self._metadata
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notifs = self._nixl.agent.get_new_notifs()
            except Exception:
                log.exception("NIXL receiver %s: polling notifications failed", self._nixl.name)
                notifs = {}
            if not notifs:
                self._stop.wait(IDLE_POLL_S)
                continue
            for sender, messages in notifs.items():
                for message in messages:
                    try:
                        self._handle(str(sender), message)
                    except Exception:
                        log.exception("NIXL receiver: handling a notification from %s", sender)

    def _handle(self, sender: str, message: bytes) -> None:
        try:
            note = json.loads(message)
            request_id, fence = str(note["r"]), int(note["f"])
            dst, num_bytes = [int(b) for b in note["d"]], int(note["b"])
            traceparent = str(note.get("t", ""))
            capability = bytes.fromhex(str(note.get("c", "")))
        except (ValueError, KeyError, TypeError) as e:
            self.num_malformed += 1
            log.warning(
                "NIXL receiver: malformed notification from %s (%r): %r",
                sender, e, message[:MAX_LOGGED_BYTES],
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
            self._landing.landed(request_id, fence, dst, num_bytes)
        except PushRefused as e:
            span.set_status(Status(StatusCode.ERROR, f"{e.status}: {e}"))
            span.end()
            self._refuse(sender, request_id, f"{e.status}: {e}")
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

    def _refuse(self, sender: str, request_id: str, reason: str) -> None:
        self.num_refused += 1
        self._landing.refused(request_id, reason)
        if request_id not in self._warned:
            if len(self._warned) >= _MAX_WARNED:
                self._warned.clear()
            self._warned.add(request_id)
            log.warning("NIXL push from %s for %r refused: %s", sender, request_id, reason)

    def close(self) -> None:
        """Stop the notification thread and deregister the pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()
        self._nixl.deregister()
