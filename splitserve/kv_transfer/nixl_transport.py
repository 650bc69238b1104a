"""KV transfer over NIXL: one-sided WRITEs straight from pool to pool, then a notification.

    prefill worker (NixlSender)                        decode worker (NixlReceiver)
    pool ─ registered once, one prepped                pool ─ registered once; endpoint():
           descriptor per block;                              agent name, metadata, base,
           endpoint(): its agent name                         block_bytes, page, num_blocks,
           (published in the registry)                        device (in the registry)
                │                                             │
    push: make_prepped_xfer(WRITE,                            │
          src ids ──────── bytes (UCX) ─────────────▶  dst blocks (no receiver CPU involved)
          notif) ───────── notification ───────────▶  poller thread: sender vouched for
    poll check_xfer_state until DONE                   (nixl_vetting.py)? else dropped;
                                                       JSON {r, f, d, n, b, c}:
                                                       Landing.allowed_blocks (fence) ─▶ landed
                                                       or Landing.refused (request fails)

The sender loads each peer's metadata and preps its remote block list once (keyed by the remote
agent name, so a restarted peer, which publishes a new name, gets a new entry). NIXL merges
adjacent descriptors of one transfer into one copy. The receiver is in nixl_receiver.py.

With sliding layers kept apart (engine/window_slots.py) both pools are registered and each
descriptor list is the blocks, then the window pool's slots (index num_blocks + s: the sliding
layers of slot s): one transfer writes a batch's blocks (full layers) and the slots the
receiver gave the blocks its first query sees (`Push.dst_window_slots`, named in the
notification's "w"), so the bytes moved are the full layers' of every block and the sliding
layers' of a window's worth only.

NOTE: the write is one-sided: the receiver checks the reservation only after the bytes are in
its pool. A refused notification (stale fence, unknown request, blocks outside the reservation)
fails the request on the decode side; it cannot un-write the bytes. Whoever loads a receiver's
metadata can write into its pool, so the registry keeps it encrypted at rest (`Concealed`); a
notification names its sender's agent and nothing else authenticates it, so agent names are
128 random bits, concealed too, and a receiver drops a notification from an agent no member
vouches for without touching any request.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.engine.kv_connector import KVConnector, KVRegion
from splitserve.kv_transfer.registry_conceal import Concealed
from splitserve.kv_transfer.transport import KVSender, Peer, Push, PushResult, TransferError

log = logging.getLogger(__name__)

SPIN_S, POLL_S = 0.001, 0.0001  # sender: yield-only polling first, then short sleeps
SENDER_FIELD = "nixl.sender"  # a sender's endpoint field: its agent name


def _blocks(
    base: int, block_bytes: int, num_blocks: int, device: int
) -> list[tuple[int, int, int]]:
    """One (address, length, device) descriptor per block."""
    return [(base + b * block_bytes, block_bytes, device) for b in range(num_blocks)]


def _pools(region: KVRegion, device: int) -> list[tuple[int, int, int]]:
    """The region's descriptors: one per block, then one per window slot (if any)."""
    out = _blocks(region.base_address, region.block_bytes, region.num_blocks, device)
    if region.window is not None:
        w = region.window
        out += _blocks(w.base_address, w.slot_bytes, w.num_slots, device)
    return out


def page_text(region: KVRegion) -> str:
    """What a block holds, as a receiver publishes it (`nixl.page`) and a sender compares it:
    blocks of equal size may still hold another layout (latents, or other heads or widths),
    and a window pool (its sliding layers) or none."""
    what = "MLA latents" if region.num_planes == 1 else "keys and values"
    planes, block_size, heads, dim = region.page
    dtype = str(region.dtype).removeprefix("torch.")
    text = f"{what}: {region.num_layers} layers x {planes} x {block_size} x {heads} x {dim} {dtype}"
    if region.window is not None:
        text += f" + window pool of {region.window.num_layers} sliding layers"
    return text


class NixlAgent:
    """A NIXL agent (UCX backend) with the connector's whole pool registered once; its name is
    the worker id and 128 random bits (receivers take notifications by name: not guessable)."""

    def __init__(self, connector: KVConnector, worker_id: str) -> None:
        try:
            from nixl_cu13 import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(f"NIXL transport unavailable: cannot import nixl_cu13 ({e})") from e
        self.region: KVRegion = connector.region()
        if not self.region.addressable:
            raise RuntimeError(
                "NIXL writes whole blocks into one registered pool, and at tensor_parallel_size "
                "> 1 each rank's pool holds only its KV heads: use --kv-transport grpc (or auto, "
                "which leaves NIXL out)"
            )
        device = self.region.device
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.device_id = (device.index or 0) if device.type == "cuda" else 0
        self.name = f"{worker_id}-{secrets.token_hex(16)}"
        size = self.region.num_blocks * self.region.block_bytes
        window = self.region.window
        try:
            # NOTE: no progress thread: the Python API runs it with a 0 us delay, so it spins a
            # whole core per agent. Transfers progress when the sender polls check_xfer_state
            # and the receiver polls get_new_notifs, which is enough for UCX (shm and TCP).
            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.agent = nixl_agent(self.name, config)
            if "UCX" not in self.agent.backends:
                raise RuntimeError("the UCX backend plugin is missing")
            pool = [(self.region.base_address, size, self.device_id, "")]
            if window is not None:
                span = window.num_slots * window.slot_bytes
                pool.append((window.base_address, span, self.device_id, ""))
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
    blocks: Any  # its prepped descriptor list, one per block, then one per window slot
    num_blocks: int
    num_slots: int = 0


class NixlSender(KVSender):
    """Writes blocks into peers' pools with NIXL. Thread-safe: one lock serialises agent calls,
    each short; a push polls its transfer without holding the lock in between."""

    name = "nixl"

    def __init__(self, connector: KVConnector, worker_id: str) -> None:
        self._nixl = NixlAgent(connector, worker_id)
        region = self._nixl.region
        self._block_bytes = region.block_bytes
        self._page = page_text(region)
        self._num_blocks = region.num_blocks
        self._slot_bytes = region.window.slot_bytes if region.window is not None else 0
        self._num_slots = region.window.num_slots if region.window is not None else 0
        self._lock = threading.Lock()
        self._peers: dict[str, _RemotePeer] = {}
        self._closed = False
        try:
            self._local = self._nixl.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _pools(region, self._nixl.device_id), self._nixl.mem_type
            )
        except Exception as e:
            self._nixl.deregister()
            raise RuntimeError(f"NIXL agent {self._nixl.name!r}: cannot prep the pool: {e}") from e

    def endpoint(self) -> dict[str, bytes]:
        """Its agent name, by which receivers vouch for its notifications (concealed at rest)."""
        return {SENDER_FIELD: Concealed(self._nixl.name.encode())}

    def push(self, peer: Peer, push: Push, timeout_s: float) -> PushResult:
        """Write the source blocks into the peer's destination blocks and notify it; returns once
        the write is complete (the peer then checks the fence and records the blocks)."""
        deadline = time.monotonic() + timeout_s
        if push.ready is not None:
            push.ready.wait()  # NOTE: before reading the source blocks: their writes may be queued
        src, dst = list(push.src_block_ids), list(push.dst_block_ids)
        src_slots, dst_slots = list(push.src_window_slots), list(push.dst_window_slots)
        num_bytes = len(src) * self._block_bytes + len(src_slots) * self._slot_bytes
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)  # nothing unless a span is recording
        note = {
            "r": push.request_id, "f": push.fence, "d": dst, "n": push.num_tokens,
            "b": num_bytes, "t": carrier.get("traceparent", ""), "c": push.capability.hex(),
        }  # fmt: skip
        if dst_slots:
            note["w"] = dst_slots
        notif = json.dumps(note, separators=(",", ":")).encode()
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
                for ids, limit in ((src_slots, self._num_slots), (dst_slots, remote.num_slots)):
                    if not all(0 < i < limit for i in ids):
                        raise TransferError(
                            f"window slots {ids} not in [1, {limit})", "INVALID_ARGUMENT"
                        )
                local_ids = src + [self._num_blocks + s for s in src_slots]
                remote_ids = dst + [remote.num_blocks + s for s in dst_slots]
                handle = agent.make_prepped_xfer(
                    "WRITE", self._local, local_ids, remote.blocks, remote_ids, notif
                )
                state = agent.transfer(handle)
            what = f"NIXL write of {len(src)} blocks, {len(src_slots)} window slots"
            what += f" to {peer.worker_id}"
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
            slot_bytes, num_slots = (
                int(ep.get("nixl.slot_bytes", 0)),
                int(ep.get("nixl.num_slots", 0)),
            )
            window_base = int(ep.get("nixl.window_base", 0))
        except (KeyError, ValueError) as e:
            raise TransferError(
                f"peer {peer.worker_id} publishes no usable NIXL endpoint ({e!r})",
                "FAILED_PRECONDITION",
            ) from e
        if block_bytes != self._block_bytes or slot_bytes != self._slot_bytes:
            raise TransferError(
                f"peer {peer.worker_id} has {block_bytes}-byte KV blocks ({slot_bytes}-byte "
                f"window slots), this worker {self._block_bytes}-byte ones "
                f"({self._slot_bytes}-byte) (different model, dtype or block size, or one keeps "
                "sliding layers in a window pool)",
                "FAILED_PRECONDITION",
            )
        page = ep.get("nixl.page", b"").decode()
        if page and page != self._page:
            raise TransferError(
                f"peer {peer.worker_id}'s KV blocks hold {page}, this worker's {self._page} "
                "(prefill and decode workers must serve the same model, and both keep sliding "
                "layers in a window pool or neither)",
                "FAILED_PRECONDITION",
            )
        agent = self._nixl.agent
        agent.add_remote_agent(metadata)  # NOTE: connects (UCX endpoint) while holding the lock
        try:
            descs = _blocks(base, block_bytes, num_blocks, device)
            descs += _blocks(window_base, slot_bytes, num_slots, device)
            blocks = agent.prep_xfer_dlist(name, descs, mem_type)
        except Exception:
            agent.remove_remote_agent(name)
            raise
        remote = self._peers[name] = _RemotePeer(name, blocks, num_blocks, num_slots)
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
