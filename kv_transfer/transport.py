"""The pluggable KV transport: how a prefill worker's packed blocks reach a decode worker.

The sender side is a `KVTransport` (chosen by name through `get_transport`); the receiving
side is whatever serves the transport (the gRPC servicer today), which hands verified pushes to
a `KVReceiver` that owns the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import grpc

from splitserve.engine.errors import SplitserveError
from splitserve.kv_transfer.wire import Buffer, CacheLayout
from splitserve.protos.v1 import kv_transfer_pb2


@dataclass(frozen=True)
class PushResult:
    """What the receiver acknowledged for one push."""

    num_blocks: int
    num_bytes: int


class TransferError(SplitserveError):
    """A push that did not land. `code` is the receiver's gRPC status (None if unknown); the
    request fails with it (UNAVAILABLE when unknown), so the gateway can retry elsewhere."""

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, details: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.details = details
        self.status = code.name if code is not None else "UNAVAILABLE"


class KVTransport(ABC):
    """Sends one header + payload to a receiver and waits for its acknowledgement.

    Implementations are thread-safe: many pushes may be in flight from different threads.
    """

    @abstractmethod
    def send(
        self,
        address: str,
        header: kv_transfer_pb2.KVTransferHeader,
        payload: Buffer,
        timeout_s: float,
    ) -> PushResult:
        """Push `payload` (described by `header`, see `wire.make_header`) to `address`.

        Raises `TransferError` when the push is refused or does not finish within `timeout_s`;
        a refused push wrote nothing on the receiver.
        """

    @abstractmethod
    def close(self) -> None:
        """Release connections; the transport must not be used afterwards."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class KVReceiver(Protocol):
    """The decode side's cache owner, as a transport server sees it."""

    def layout(self) -> CacheLayout:
        """The receiving cache's layout; every header is validated against it."""
        ...

    def check_push(self, header: kv_transfer_pb2.KVTransferHeader) -> Collection[int]:
        """The destination blocks `header.request_id` may write, or raise `wire.PushRefused`
        (NOT_FOUND: no such reservation; FAILED_PRECONDITION: stale fence)."""
        ...

    def on_blocks(self, header: kv_transfer_pb2.KVTransferHeader, payload: Buffer) -> None:
        """Write a push whose header, size and checksum were verified (e.g. with
        `wire.unpack_into`) and record progress. May raise `wire.PushRefused` (the reservation
        went away meanwhile) or `wire.KVTransferError`; it must write nothing when it raises."""
        ...


def _grpc_transport() -> type[KVTransport]:
    # Imported on demand so that choosing another transport never loads this one.
    from splitserve.kv_transfer.grpc_transport import GrpcKVTransport

    return GrpcKVTransport


TRANSPORTS: dict[str, Callable[[], type[KVTransport]]] = {"grpc": _grpc_transport}
"""Transport name -> a loader of its class (a loader, so unused transports are never imported)."""


def get_transport(name: str) -> KVTransport:
    """A new transport of the kind `name` (a key of `TRANSPORTS`)."""
    loader = TRANSPORTS.get(name)
    if loader is None:
        raise ValueError(f"unknown KV transport {name!r}; available: {sorted(TRANSPORTS)}")
    return loader()()
