"""Pluggable KV transports: how a prefill worker's blocks reach a decode worker's reserved blocks.

Each transport has two halves behind two small classes, built by name from `TRANSPORTS`:

    prefill worker                                    decode worker
    KVSender.push(peer, Push) ─── bytes, by any means ──▶ KVReceiver (started at boot)
         reads pinned blocks from its pool                 checks each push with the `Landing`
         (engine KV connector)                             (reservation + fence) and records
                                                           the blocks that landed

A decode worker advertises the transports it started (and what a sender needs to reach them:
`KVReceiver.endpoint`) in the registry; a prefill worker picks, per peer, the first of its own
transports, in `PREFERENCE` order, that the peer also offers, and publishes what its receivers
know its senders by (`KVSender.endpoint`). Endpoint values that grant access on their own are
marked `Concealed`: the registry keeps them encrypted at rest (registry_conceal.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from opentelemetry import trace

from splitserve.engine.errors import SplitserveError

if TYPE_CHECKING:
    from splitserve.engine.kv_connector import KVConnector, ReadyBlocks

PREFERENCE = ("nixl", "grpc")
"""Transport names, fastest first; `auto` takes the first both ends support."""

TRANSPORT_CHOICES = ("auto", *PREFERENCE)


@dataclass(frozen=True)
class Push:
    """One batch of a request's blocks: source blocks on this worker, destination blocks
    (reserved under `fence`) on the peer, in the same order; with sliding layers kept apart
    (engine/window_slots.py), the window slots whose sliding layers' KV goes with them, source
    and destination pairwise (`window_pairs`)."""

    request_id: str
    fence: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens complete on the peer once this push lands
    ready: ReadyBlocks | None = None  # wait for its event before reading the source blocks
    capability: bytes = b""  # the reservation's (KVDestination.capability); every push carries it
    src_window_slots: tuple[int, ...] = ()
    dst_window_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError("a push needs as many destination blocks as source blocks")
        if len(self.src_window_slots) != len(self.dst_window_slots):
            raise ValueError("a push needs as many destination window slots as source ones")


def window_pairs(
    src_slots: Sequence[int], dst_slots: Sequence[int], num_blocks: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The window slots a push of `num_blocks` blocks moves: for each block the receiver gave a
    slot (`dst_slots[i]`, 0: none; empty: it keeps no window pool), the sender's (`src_slots`,
    pinned for the push). TransferError (FAILED_PRECONDITION) if the sender holds none there:
    it never sends a block's full layers without the sliding layers the receiver reads."""
    if not dst_slots:
        return (), ()
    if len(dst_slots) != num_blocks:
        raise TransferError(
            f"{len(dst_slots)} destination window slots for {num_blocks} blocks",
            "FAILED_PRECONDITION",
        )
    src, dst = [], []
    for i, slot in enumerate(dst_slots):
        if not slot:
            continue
        mine = src_slots[i] if i < len(src_slots) else 0
        if not mine:
            raise TransferError(
                f"the receiver reads the sliding layers of block {i} of this push, and this "
                "worker holds no window slot for it (no window pool, or its window moved on)",
                "FAILED_PRECONDITION",
            )
        src.append(mine)
        dst.append(slot)
    return tuple(src), tuple(dst)


@dataclass(frozen=True)
class Peer:
    """A decode worker as a sender reaches it: its id, its gRPC address, and what its
    transports published (`KVReceiver.endpoint`, read from the registry)."""

    worker_id: str
    address: str
    endpoint: Mapping[str, bytes]


@dataclass(frozen=True)
class PushResult:
    """What the receiver acknowledged for one push."""

    num_blocks: int
    num_bytes: int


class TransferError(SplitserveError):
    """A push that did not land. `status` is the receiver's answer when it gave one (e.g.
    NOT_FOUND: no reservation; FAILED_PRECONDITION: stale fence), else UNAVAILABLE; the request
    fails with it, so the gateway can retry elsewhere."""

    def __init__(self, message: str, status: str = "UNAVAILABLE") -> None:
        super().__init__(message)
        self.status = status


class PushRefused(SplitserveError):
    """A receiver refuses a push that is not bad input: no such reservation (NOT_FOUND) or a
    stale fence / reclaimed reservation (FAILED_PRECONDITION). Nothing was written."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class Landing(Protocol):
    """The decode worker's reservations, as a receiver sees them."""

    def check_capability(self, request_id: str, capability: bytes) -> None:
        """Raises PushRefused (PERMISSION_DENIED) unless `capability` is the one the
        reservation of `request_id` was minted with (checked before anything lands)."""
        ...

    def check_window(
        self,
        request_id: str,
        fence: int,
        dst_block_ids: Sequence[int],
        dst_window_slots: Sequence[int],
    ) -> None:
        """Receivers whose pool keeps a window pool: raises PushRefused (FAILED_PRECONDITION)
        unless `dst_window_slots` are exactly the slots the reservation gave those of
        `dst_block_ids` that have one, in order (a push writes every block's sliding layers
        the receiver will read, and only into its own slots)."""
        ...

    def allowed_blocks(self, request_id: str, fence: int) -> frozenset[int]:
        """The destination blocks `request_id` may still write under `fence`; raises
        PushRefused (NOT_FOUND / FAILED_PRECONDITION) when it may write none."""
        ...

    def landed(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], num_bytes: int
    ) -> None:
        """These blocks hold the request's KV now. Raises PushRefused if the reservation went
        away or moved on meanwhile (the request then fails; nothing is admitted)."""
        ...

    def refused(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], reason: str
    ) -> bool:
        """A push for `request_id` under `fence` into `dst_block_ids` was refused after its
        bytes arrived (one-sided transports): the live reservation fails rather than wait for
        blocks that will not come or keep KV the push may have overwritten. A stale writer's
        push (an older fence) that wrote only blocks the live writer has yet to fill leaves it
        be. True if the reservation fails."""
        ...

    def hold(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], num_bytes: int
    ) -> AbstractContextManager[None]:
        """For receivers that write the blocks themselves: check the push like `landed`, keep
        the reservation from being reclaimed while the body writes, then record the blocks
        as landed (if the body did not raise)."""
        ...


class KVSender(ABC):
    """The prefill side of a transport. Thread-safe: many pushes may be in flight."""

    name: ClassVar[str]

    def endpoint(self) -> dict[str, bytes]:
        """What receivers know this sender by (published in the registry before it pushes)."""
        return {}

    @abstractmethod
    def push(self, peer: Peer, push: Push, timeout_s: float) -> PushResult:
        """Move the source blocks into the peer's destination blocks; return once the peer has
        them (or, for a one-sided write, once they are written and the peer notified).

        Raises TransferError when the push did not land within `timeout_s`.
        """

    @abstractmethod
    def close(self) -> None:
        """Release connections and registrations; the sender must not be used afterwards."""


class KVReceiver(ABC):
    """The decode side of a transport, started with the worker."""

    name: ClassVar[str]

    def endpoint(self) -> dict[str, bytes]:
        """What a sender needs to reach this receiver (published in the registry)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Stop receiving; pushes after this are refused."""


PushObserver = Callable[[int, float | None, bool], None]
"""Told of every push a receiver handles: (payload bytes, seconds if the receiver could time
it, whether it landed)."""


Vouch = Callable[[str], Collection[bytes]]
"""What live members published under one endpoint field (e.g. the agent names of NIXL senders),
read from their sealed registry records: how a receiver that can't check a secret on each
push vets its senders. May raise (Redis unreachable): the receiver asks again later."""


@dataclass(frozen=True)
class ReceiverBind:
    """Where a receiver that listens on a socket of its own binds (`host`, `port`; port 0 takes
    a free one) and the host it publishes for senders (`public_host`; default: `host`); who
    may push to it: a push must carry `cluster_secret` when one is set (`kv_transfer/
    cluster.py`), and a receiver that vets senders by name takes them from `vouch` (None:
    any sender that reaches it)."""

    host: str = "127.0.0.1"
    port: int = 0
    public_host: str | None = None
    cluster_secret: str = field(default="", repr=False)
    vouch: Vouch | None = field(default=None, repr=False, compare=False)


class ReceiverFactory(Protocol):
    def __call__(
        self,
        connector: KVConnector,
        landing: Landing,
        worker_id: str,
        tracer: trace.Tracer | None = None,
        on_push: PushObserver | None = None,
        bind: ReceiverBind | None = None,
    ) -> KVReceiver: ...


@dataclass(frozen=True)
class TransportKind:
    """How to build each half of one transport (loaders, so unused ones are never imported)."""

    sender: Callable[..., KVSender]  # (connector, worker id, cluster secret = "")
    receiver: ReceiverFactory


def _grpc() -> TransportKind:
    from splitserve.kv_transfer.grpc_receiver import GrpcKVReceiver
    from splitserve.kv_transfer.grpc_transport import GrpcKVSender

    return TransportKind(
        sender=lambda connector, worker_id, cluster_secret="": GrpcKVSender(
            connector, cluster_secret=cluster_secret
        ),
        receiver=GrpcKVReceiver,
    )


def _nixl() -> TransportKind:
    from splitserve.kv_transfer.nixl_receiver import NixlReceiver
    from splitserve.kv_transfer.nixl_transport import NixlSender

    # NOTE: a NIXL receiver takes notifications only from senders whose agent names members
    # published (`ReceiverBind.vouch`); the cluster secret guards the gRPC planes.
    return TransportKind(
        sender=lambda connector, worker_id, cluster_secret="": NixlSender(connector, worker_id),
        receiver=NixlReceiver,
    )


TRANSPORTS: dict[str, Callable[[], TransportKind]] = {"grpc": _grpc, "nixl": _nixl}


def transport_kind(name: str) -> TransportKind:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; available: {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]()


def choose(mine: Sequence[str], theirs: Sequence[str]) -> str | None:
    """The fastest transport both ends offer, or None."""
    return next((name for name in PREFERENCE if name in mine and name in theirs), None)
