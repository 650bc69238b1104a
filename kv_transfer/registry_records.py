"""What the registry stores and answers with: worker advertisements, block records, and the
errors of its steps (see `registry.py` for the life cycle)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.errors import FailedPrecondition

WORKER_KINDS = ("prefill", "decode", "colocated")
RECORD_STATES = ("reserved", "writing", "owned")


class RegistryError(FailedPrecondition):
    """A registry operation was refused (e.g. a request id that already has a record)."""


class BlockSizeMismatch(RegistryError):
    """A worker whose KV block size differs from the deployment's."""


class StaleFenceError(RegistryError):
    """The caller no longer holds the record: it is gone, carries another fence, or has moved on.

    `reason` is one of "missing", "fence", "state", "writer".
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker advertises for discovery and routing; refreshed by every heartbeat."""

    worker_id: str
    kind: str
    address: str
    load: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 0  # tokens per KV block (0: not a KV-holding worker)
    kv_transports: tuple[str, ...] = ()  # KV transports it sends or receives with, fastest first

    def __post_init__(self) -> None:
        if not self.worker_id or not self.address:
            raise ValueError("worker_id and address must be non-empty")
        if self.kind not in WORKER_KINDS:
            raise ValueError(f"kind must be one of {WORKER_KINDS}, got {self.kind!r}")
        for name in ("load", "num_free_blocks", "num_total_blocks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Reservation:
    """A new block record: `fence` must accompany every later step for this request."""

    request_id: str
    decode_worker: str
    fence: int
    block_ids: tuple[int, ...]
    lease_ms: int


@dataclass(frozen=True)
class BlockRecord:
    """A snapshot of one request's block record. `ttl_ms` is None only if it has no lease."""

    request_id: str
    state: str
    owner: str
    writer: str
    fence: int
    block_ids: tuple[int, ...]
    ttl_ms: int | None
