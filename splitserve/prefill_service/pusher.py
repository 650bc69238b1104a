"""Pushes a request's KV blocks to its decode worker as prefill chunks finish.

The engine's KV connector reports each batch of completed blocks (pinned) after the step that
computed them; the request's handler thread pushes each batch through the transport chosen
for the decode worker, while the engine computes the next chunk, then releases it:

    prompt   |== block 0 ==|== block 1 ==|== block 2 ==|= 3 (partial) =|
    step 1   [computed.......]                                           -> push 0
    step 2                   [computed.................]                 -> push 1
    step 3                                  [computed.....................] -> push 2, 3 (last)

Blocks the decode worker already caches (its `num_cached_tokens`) are never reported. With
sliding layers kept apart, a block the decode worker gave a window slot (`window_slots`: those
its first query sees) goes with its sliding layers' KV from this worker's slot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.transport import (
    KVSender,
    Peer,
    Push,
    PushResult,
    TransferError,
    choose,
    window_pairs,
)
from splitserve.protos.v1 import worker_pb2

if TYPE_CHECKING:
    from splitserve.engine.kv_connector import KVConnector, ReadyBlocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """How this worker reaches one decode worker: the transport and what it needs."""

    sender: KVSender
    peer: Peer


@dataclass(frozen=True)
class PeerRoute:
    """The front's choice for one decode worker: which transport, and the peer it reaches."""

    transport: str
    peer: Peer


class Senders:
    """What this worker's transports are (names fastest first, and what receivers know them by:
    the engine core started them); picks one per decode worker and remembers its peer."""

    def __init__(
        self, names: Sequence[str], endpoint: Mapping[str, bytes], registry: Registry
    ) -> None:
        self.names = tuple(names)
        self._endpoint = dict(endpoint)
        self.registry = registry
        self._peers: dict[tuple[str, str], Peer] = {}
        self._lock = threading.Lock()

    def endpoint(self) -> dict[str, bytes]:
        """What receivers know this worker's senders by (its record in the registry)."""
        return dict(self._endpoint)

    def route(self, destination: worker_pb2.KVDestination) -> PeerRoute:
        theirs = list(destination.kv_transports) or ["grpc"]
        name = choose(self.names, theirs)
        if name is None:
            raise TransferError(
                f"no KV transport in common with {destination.worker_id}: it receives with "
                f"{theirs}, this worker sends with {list(self.names)}",
                "FAILED_PRECONDITION",
            )
        key = (destination.worker_id, name)
        with self._lock:
            peer = self._peers.get(key)
        if peer is None or peer.address != destination.address:
            endpoint = self.registry.kv_endpoint(destination.worker_id)
            if endpoint is None and name == "grpc" and not destination.kv_transports:
                # NOTE: a peer that names no transport receives pushes on its own address
                endpoint = {}
            if endpoint is None:
                # NOTE: one that names its transports has a receiver of its own, whose record
                # may have lapsed (a host paused past its TTL): never its front's address,
                # which serves no pushes; retryable, and nothing is cached
                raise TransferError(
                    f"{destination.worker_id} published no {name} endpoint in the registry",
                    "UNAVAILABLE",
                )
            peer = Peer(destination.worker_id, destination.address, endpoint)
            with self._lock:
                self._peers[key] = peer
            log.info("KV to %s goes over %s", destination.worker_id, name)
        return PeerRoute(name, peer)

    def forget(self, worker_id: str) -> None:
        """Drop what is cached of a peer (it failed; it may have restarted)."""
        with self._lock:
            for key in [k for k in self._peers if k[0] == worker_id]:
                del self._peers[key]


class RequestPusher:
    """Sends one request's batches, in order, from the handler's thread."""

    def __init__(
        self,
        request_id: str,
        destination: worker_pb2.KVDestination,
        route: Route,
        connector: KVConnector,
        timeout_s: float,
    ) -> None:
        self.request_id = request_id
        self.destination = destination
        self.route = route
        self.connector = connector
        self.timeout_s = timeout_s
        self.num_blocks = 0
        self.num_bytes = 0
        self.done = False

    def send(self, batch: ReadyBlocks) -> None:
        """Push one batch (nothing for an empty final one) and release its blocks."""
        if batch.block_ids:
            end = batch.first_index + len(batch.block_ids)
            dst = tuple(self.destination.block_ids[batch.first_index : end])
            slots = self.destination.window_slots[batch.first_index : end]
            src_slots, dst_slots = window_pairs(batch.window_slots, slots, len(dst))
            push = Push(
                self.request_id, self.destination.fence, batch.block_ids, dst,
                batch.num_tokens, batch, self.destination.capability, src_slots, dst_slots,
            )  # fmt: skip
            result: PushResult = self.route.sender.push(self.route.peer, push, self.timeout_s)
            self.connector.release(self.request_id, batch.block_ids)
            self.num_blocks += result.num_blocks
            self.num_bytes += result.num_bytes
        self.done = batch.is_last
