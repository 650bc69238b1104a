"""What the registry stores and answers with: worker advertisements, block records, and the
errors of its steps (see `registry.py` for the life cycle)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from splitserve.engine.errors import FailedPrecondition, Unavailable

WORKER_KINDS = ("prefill", "decode", "colocated")
RECORD_STATES = ("reserved", "writing", "owned")


class RegistryError(FailedPrecondition):
    """A registry operation was refused (e.g. a request id that already has a record)."""


class BlockSizeMismatch(RegistryError):
    """A worker whose KV block size (or KV dtype) differs from the deployment's."""


class RegistryUnavailable(Unavailable):
    """Redis did not answer (down, restarting, unreachable) within the call's retry budget."""


class RecordLost(RegistryUnavailable):
    """The record was issued before Redis lost its data (a restart) and its worker has not
    re-published it yet."""


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
    # What one request may ask of it (0: not advertised): the gateway refuses more up front.
    max_num_seqs: int = 0  # sequences it runs at once: a request's n can't exceed it
    max_model_len: int = 0  # prompt plus generated tokens of one sequence
    kv_dtype: str = ""  # what its KV blocks hold (wire dtype name; "": not a KV-holding worker)
    adapters: tuple[str, ...] = ()  # the LoRA adapters it serves, by name
    # Its tensor-parallel degree (ranks, one GPU each). KV moves between workers as whole-head
    # blocks whatever the degrees (engine/parallel/kv_shards.py); a worker at TP > 1 offers
    # only transports that copy through its connector (gRPC), which `can_transfer` accounts for.
    tensor_parallel_size: int = 1
    # Its engine loop's longest recent wait to answer (ms; about its longest step under its
    # load): a gateway that has not yet waited on it paces its deadlines by this
    # (runtime/pace.py), so a worker stepping 1 s is not suspect at a 1 s floor (0: not known).
    pace_ms: int = 0

    def __post_init__(self) -> None:
        if not self.worker_id or not self.address:
            raise ValueError("worker_id and address must be non-empty")
        if self.kind not in WORKER_KINDS:
            raise ValueError(f"kind must be one of {WORKER_KINDS}, got {self.kind!r}")
        for name in (
            "load",
            "num_free_blocks",
            "num_total_blocks",
            "block_size",
            "max_num_seqs",
            "max_model_len",
            "tensor_parallel_size",
            "pace_ms",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def as_text(value: Any) -> str:
    """A value read from Redis (bytes) or about to be written, as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_bytes(value: Any) -> bytes:
    """A value read from Redis, as the bytes it holds."""
    return value if isinstance(value, bytes) else str(value).encode()


def worker_from_fields(raw: dict[str, str]) -> WorkerInfo:
    """A WorkerInfo from its advertisement's fields (as the registry stores them)."""
    return WorkerInfo(
        worker_id=raw["worker_id"],
        kind=raw["kind"],
        address=raw["address"],
        load=int(raw["load"]),
        num_free_blocks=int(raw["num_free_blocks"]),
        num_total_blocks=int(raw["num_total_blocks"]),
        block_size=int(raw.get("block_size", 0)),
        kv_transports=tuple(n for n in raw.get("kv_transports", "").split(",") if n),
        max_num_seqs=int(raw.get("max_num_seqs", 0)),
        max_model_len=int(raw.get("max_model_len", 0)),
        kv_dtype=raw.get("kv_dtype", ""),
        adapters=tuple(json.loads(raw.get("adapters") or "[]")),
        tensor_parallel_size=int(raw.get("tensor_parallel_size", 1)),
        pace_ms=int(raw.get("pace_ms", 0)),
    )


def can_transfer(prefill: WorkerInfo, decode: WorkerInfo) -> bool:
    """Whether `prefill` can push KV to `decode`: a KV transport in common (a worker that
    advertises none speaks gRPC, as the prefill side assumes)."""
    theirs = set(decode.kv_transports or ("grpc",))
    return bool(theirs & set(prefill.kv_transports or ("grpc",)))


def check_compatible(info: WorkerInfo, other: WorkerInfo) -> None:
    """Raises BlockSizeMismatch unless `info` can exchange KV blocks with live worker `other`."""
    if other.block_size and other.block_size != info.block_size:
        raise BlockSizeMismatch(
            f"worker {info.worker_id} uses block_size {info.block_size}, but live worker "
            f"{other.worker_id} uses {other.block_size}; every worker and the gateway of a "
            "deployment must use one block size"
        )
    if other.kv_dtype and info.kv_dtype and other.kv_dtype != info.kv_dtype:
        raise BlockSizeMismatch(
            f"worker {info.worker_id} holds KV as {info.kv_dtype}, but live worker "
            f"{other.worker_id} holds {other.kv_dtype}; KV blocks move between workers as "
            "stored: use one --kv-cache-dtype"
        )


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


def ms(seconds: float, what: str) -> int:
    """`seconds` as whole milliseconds (at least 1) for Redis; ValueError unless finite, > 0."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {seconds!r}")
    return max(1, math.ceil(seconds * 1000))


def check_step(op: str, request_id: str, fence: int, status: str, detail: str) -> None:
    """Raise what a registry step's Lua status says went wrong (nothing for "ok")."""
    if status == "ok":
        return
    where = f"{op}({request_id!r}, fence={fence})"
    if status == "lost":
        raise RecordLost(f"{where}: Redis lost the record in a restart; not re-published yet")
    if status == "owner":
        raise RegistryError(f"{where}: blocks are reserved on {detail!r}, not this worker")
    message = {
        "missing": "the record is gone (released, or its lease lapsed)",
        "fence": f"the record now carries fence {detail} (superseded by a newer reserve)",
        "state": f"the record is {detail!r}, past the point this step applies to",
        "writer": f"the record is already being written by {detail!r}",
    }[status]
    raise StaleFenceError(f"{where} refused: {message}", status)
