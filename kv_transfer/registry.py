"""The Redis block-ownership registry: worker discovery, per-request block records, prefix index.

Key layout, everything under `{ns}:` (the namespace)::

    {ns}:fence                      string  global fencing counter (INCR)
    {ns}:workers:{kind}             set     ids of workers of that kind (pruned lazily)
    {ns}:worker:{kind}:{worker_id}  hash    WorkerInfo fields; PEXPIRE = heartbeat TTL
    {ns}:kv_endpoint:{worker_id}    hash    what KV senders need to reach it; same TTL
    {ns}:req:{request_id}           hash    state, owner, writer, fence, blocks; PEXPIRE = lease
    {ns}:prefix:{hash_hex}          set     ids of workers holding that block in their prefix cache
    {ns}:prefix_worker:{worker_id}  set     hash_hex of every block that worker holds

A request's record goes through::

    reserve(D) ─▶ reserved ─begin_write(P, fence)─▶ writing ─handoff(D, fence)─▶ owned
                     └──────────────── handoff(D, fence) ──────────────────────────┘
    release(fence) deletes it from any state; a lease that is not renewed deletes it on its own.

NOTE: every step that reads then writes a record is one Lua script, so checks and updates can
never interleave with another client's. A fence is issued by `reserve` only, and the fence is
never reused: whoever holds an older fence is refused by every later step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import redis

from splitserve.kv_transfer import registry_lua as lua
from splitserve.kv_transfer.registry_records import (
    RECORD_STATES,
    WORKER_KINDS,
    BlockRecord,
    BlockSizeMismatch,
    RegistryError,
    Reservation,
    StaleFenceError,
    WorkerInfo,
)

__all__ = [
    "RECORD_STATES",
    "WORKER_KINDS",
    "BlockRecord",
    "BlockSizeMismatch",
    "Registry",
    "RegistryError",
    "Reservation",
    "StaleFenceError",
    "WorkerInfo",
]
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _raw(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _ms(seconds: float, what: str) -> int:
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {seconds!r}")
    return max(1, math.ceil(seconds * 1000))


def _hex(block_hash: bytes) -> str:
    if not isinstance(block_hash, bytes) or not block_hash:
        raise TypeError(f"block hashes must be non-empty bytes, got {block_hash!r}")
    return block_hash.hex()


class Registry:
    """Who owns which KV blocks, which workers are alive, and which prefixes they hold."""

    def __init__(self, url: str, namespace: str = "splitserve") -> None:
        self._setup(redis.Redis.from_url(url), namespace)

    @classmethod
    def from_client(cls, client: redis.Redis, namespace: str = "splitserve") -> Registry:
        """A registry over an existing client (which the caller keeps and closes)."""
        registry = cls.__new__(cls)
        registry._setup(client, namespace)
        return registry

    def _setup(self, client: redis.Redis, namespace: str) -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty")
        self._client = client
        self._ns = namespace
        self._reserve = client.register_script(lua.RESERVE)
        self._begin_write = client.register_script(lua.BEGIN_WRITE)
        self._handoff = client.register_script(lua.HANDOFF)
        self._renew = client.register_script(lua.RENEW)
        self._release = client.register_script(lua.RELEASE)
        self._live_workers = client.register_script(lua.LIVE_WORKERS)
        self._clear_prefix = client.register_script(lua.CLEAR_PREFIX)

    @property
    def namespace(self) -> str:
        return self._ns

    def close(self) -> None:
        """Close the underlying client's connections."""
        self._client.close()

    # -- keys ---------------------------------------------------------------------------------

    def _worker_set(self, kind: str) -> str:
        return f"{self._ns}:workers:{kind}"

    def _worker_key(self, kind: str, worker_id: str) -> str:
        return f"{self._ns}:worker:{kind}:{worker_id}"

    def _req_key(self, request_id: str) -> str:
        if not request_id:
            raise ValueError("request_id must be non-empty")
        return f"{self._ns}:req:{request_id}"

    def _prefix_key(self, hash_hex: str) -> str:
        return f"{self._ns}:prefix:{hash_hex}"

    def _endpoint_key(self, worker_id: str) -> str:
        return f"{self._ns}:kv_endpoint:{worker_id}"

    def _prefix_worker_key(self, worker_id: str) -> str:
        return f"{self._ns}:prefix_worker:{worker_id}"

    # -- workers ------------------------------------------------------------------------------

    def register_worker(
        self, info: WorkerInfo, ttl_s: float, kv_endpoint: Mapping[str, bytes] | None = None
    ) -> None:
        """Join: check that `info` agrees with the live workers, then advertise it, with what
        senders need to reach its KV receivers (`kv_endpoint`, kept as long as it heartbeats).

        Raises BlockSizeMismatch if a live worker uses another block size: KV blocks move
        between workers whole, and the gateway's prefix hashes are per block.
        """
        if info.block_size:
            for kind in WORKER_KINDS:
                for other in self.live_workers(kind):
                    if other.block_size and other.block_size != info.block_size:
                        raise BlockSizeMismatch(
                            f"worker {info.worker_id} uses block_size {info.block_size}, but live "
                            f"worker {other.worker_id} uses {other.block_size}; every worker and "
                            "the gateway of a deployment must use one block size"
                        )
        if kv_endpoint:
            key = self._endpoint_key(info.worker_id)
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(key)
            endpoint: dict[Any, Any] = dict(kv_endpoint)
            pipe.hset(key, mapping=endpoint)
            pipe.pexpire(key, _ms(ttl_s, "ttl_s"))
            pipe.execute()
        self._advertise(info, ttl_s)

    def _advertise(self, info: WorkerInfo, ttl_s: float) -> None:
        ttl_ms = _ms(ttl_s, "ttl_s")
        key = self._worker_key(info.kind, info.worker_id)
        mapping: dict[Any, str] = {f.name: str(getattr(info, f.name)) for f in fields(info)}
        mapping["kv_transports"] = ",".join(info.kv_transports)
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, ttl_ms)
        pipe.pexpire(self._endpoint_key(info.worker_id), ttl_ms)
        pipe.sadd(self._worker_set(info.kind), info.worker_id)
        pipe.execute()

    def kv_endpoint(self, worker_id: str) -> dict[str, bytes] | None:
        """What a live worker published for reaching its KV receivers (None if nothing)."""
        raw = self._client.hgetall(self._endpoint_key(worker_id))
        endpoint = {_text(k): _raw(v) for k, v in raw.items()}
        return endpoint or None

    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        """Refresh the worker's advertisement (load, free blocks) and extend its TTL."""
        self._advertise(info, ttl_s)

    def deregister_worker(self, kind: str, worker_id: str) -> None:
        """Withdraw a worker at once (a clean shutdown); its prefix index is left to the caller."""
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._worker_key(kind, worker_id))
        pipe.delete(self._endpoint_key(worker_id))
        pipe.srem(self._worker_set(kind), worker_id)
        pipe.execute()

    def live_workers(self, kind: str) -> list[WorkerInfo]:
        """Workers of `kind` whose advertisement has not expired, sorted by id.

        Ids whose advertisement expired are pruned from the kind's set on the way.
        """
        ids = sorted(_text(m) for m in self._client.smembers(self._worker_set(kind)))
        if not ids:
            return []
        keys = [self._worker_set(kind)] + [self._worker_key(kind, i) for i in ids]
        rows = self._live_workers(keys=keys, args=ids)
        live = []
        for row in rows:
            if row:
                flat = [_text(v) for v in row]
                live.append(_worker_from_hash(dict(zip(flat[::2], flat[1::2], strict=True))))
        return live

    # -- per-request block records ------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        decode_worker: str,
        block_ids: Sequence[int],
        lease_s: float,
        *,
        replace: bool = False,
    ) -> Reservation:
        """Record that `decode_worker` set `block_ids` aside for `request_id`, with a new fence.

        Raises RegistryError if the request already has a record, unless `replace` is true: then
        the record is overwritten and every holder of the old fence is refused from now on.
        """
        if not decode_worker:
            raise ValueError("decode_worker must be non-empty")
        blocks = tuple(block_ids)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks):
            raise ValueError(f"block_ids must be ints >= 0, got {list(blocks)!r}")
        lease_ms = _ms(lease_s, "lease_s")
        key = self._req_key(request_id)
        created, value = self._reserve(
            keys=[key, f"{self._ns}:fence"],
            args=[decode_worker, json.dumps(blocks), lease_ms, "1" if replace else "0"],
        )
        if not created:
            raise RegistryError(
                f"request {request_id!r} already has a block record (state {_text(value)!r}); "
                "pass replace=True to supersede it"
            )
        return Reservation(request_id, decode_worker, int(value), blocks, lease_ms)

    def begin_write(self, request_id: str, prefill_worker: str, fence: int, lease_s: float) -> None:
        """Mark the record as being written by `prefill_worker` and renew its lease.

        Idempotent for the same writer. Raises StaleFenceError if the record is gone, carries
        another fence, is already owned, or is being written by another worker.
        """
        if not prefill_worker:
            raise ValueError("prefill_worker must be non-empty")
        status, detail = self._begin_write(
            keys=[self._req_key(request_id)],
            args=[prefill_worker, int(fence), _ms(lease_s, "lease_s")],
        )
        self._check("begin_write", request_id, fence, _text(status), _text(detail))

    def handoff(self, request_id: str, decode_worker: str, fence: int, lease_s: float) -> None:
        """Make `decode_worker` (the worker that reserved the blocks) their owner.

        The owned record keeps a lease, which the decode worker renews while it decodes, so a
        crashed decode worker's record lapses too. Idempotent for the same owner and fence.
        Raises StaleFenceError if the record is gone or carries another fence, and
        RegistryError if `decode_worker` is not the worker that reserved the blocks.
        """
        status, detail = self._handoff(
            keys=[self._req_key(request_id)],
            args=[decode_worker, int(fence), _ms(lease_s, "lease_s")],
        )
        self._check("handoff", request_id, fence, _text(status), _text(detail))

    def renew(self, request_id: str, fence: int, lease_s: float) -> bool:
        """Extend the lease; False if the record is gone or carries another fence."""
        renewed = self._renew(
            keys=[self._req_key(request_id)], args=[int(fence), _ms(lease_s, "lease_s")]
        )
        return bool(renewed)

    def release(self, request_id: str, fence: int | None = None) -> bool:
        """Delete the record (only if it carries `fence`, when given); True if it was deleted."""
        key = self._req_key(request_id)
        if fence is None:
            return bool(self._client.delete(key))
        return bool(self._release(keys=[key], args=[int(fence)]))

    def get_record(self, request_id: str) -> BlockRecord | None:
        """The request's record, or None if it has none (never reserved, released or expired)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hgetall(self._req_key(request_id))
        pipe.pttl(self._req_key(request_id))
        raw, ttl = pipe.execute()
        if not raw:
            return None
        rec = {_text(k): _text(v) for k, v in raw.items()}
        return BlockRecord(
            request_id=request_id,
            state=rec["state"],
            owner=rec["owner"],
            writer=rec["writer"],
            fence=int(rec["fence"]),
            block_ids=tuple(json.loads(rec["blocks"])),
            ttl_ms=int(ttl) if ttl >= 0 else None,
        )

    def expired_requests(self, candidates: Iterable[str]) -> set[str]:
        """Those of `candidates` that have no record any more (lease lapsed or released)."""
        ids = list(dict.fromkeys(candidates))
        if not ids:
            return set()
        pipe = self._client.pipeline(transaction=False)
        for request_id in ids:
            pipe.exists(self._req_key(request_id))
        return {rid for rid, n in zip(ids, pipe.execute(), strict=True) if not n}

    def request_record_keys(self) -> list[str]:
        """Every request record key in this namespace (SCAN; for leak checks, not hot paths)."""
        pattern = f"{_glob_escape(self._ns)}:req:*"
        return sorted(_text(k) for k in self._client.scan_iter(match=pattern, count=1000))

    def _check(self, op: str, request_id: str, fence: int, status: str, detail: str) -> None:
        if status == "ok":
            return
        where = f"{op}({request_id!r}, fence={fence})"
        if status == "owner":
            raise RegistryError(f"{where}: blocks are reserved on {detail!r}, not this worker")
        message = {
            "missing": "the record is gone (released, or its lease lapsed)",
            "fence": f"the record now carries fence {detail} (superseded by a newer reserve)",
            "state": f"the record is {detail!r}, past the point this step applies to",
            "writer": f"the record is already being written by {detail!r}",
        }[status]
        raise StaleFenceError(f"{where} refused: {message}", status)

    # -- prefix index -------------------------------------------------------------------------

    def add_prefix_blocks(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Record that `worker_id` holds these blocks in its prefix cache."""
        hexes = [_hex(h) for h in hashes]
        if not hexes:
            return
        pipe = self._client.pipeline(transaction=True)
        for h in hexes:
            pipe.sadd(self._prefix_key(h), worker_id)
        pipe.sadd(self._prefix_worker_key(worker_id), *hexes)
        pipe.execute()

    def remove_prefix_blocks(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Record that `worker_id` evicted these blocks from its prefix cache."""
        hexes = [_hex(h) for h in hashes]
        if not hexes:
            return
        pipe = self._client.pipeline(transaction=True)
        for h in hexes:
            pipe.srem(self._prefix_key(h), worker_id)
        pipe.srem(self._prefix_worker_key(worker_id), *hexes)
        pipe.execute()

    def clear_prefix_blocks(self, worker_id: str) -> int:
        """Remove every prefix entry of `worker_id` (it restarted or died); returns how many."""
        removed = self._clear_prefix(
            keys=[self._prefix_worker_key(worker_id)], args=[worker_id, self._prefix_key("")]
        )
        return int(removed)

    def prefix_match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each worker, how many leading blocks of the hash chain it holds consecutively.

        Workers holding none of the leading block are left out. One round trip.
        """
        hexes = [_hex(h) for h in hashes]
        if not hexes:
            return {}
        pipe = self._client.pipeline(transaction=True)
        for h in hexes:
            pipe.smembers(self._prefix_key(h))
        matched: dict[str, int] = {}
        for i, members in enumerate(pipe.execute()):
            # NOTE: a worker counts block i only if it held blocks 0..i-1, since a chained hash
            # is only useful after its whole prefix.
            for m in members:
                worker = _text(m)
                if matched.get(worker, 0) == i:
                    matched[worker] = i + 1
        return matched


def _worker_from_hash(raw: dict[str, str]) -> WorkerInfo:
    return WorkerInfo(
        worker_id=raw["worker_id"],
        kind=raw["kind"],
        address=raw["address"],
        load=int(raw["load"]),
        num_free_blocks=int(raw["num_free_blocks"]),
        num_total_blocks=int(raw["num_total_blocks"]),
        block_size=int(raw.get("block_size", 0)),
        kv_transports=tuple(n for n in raw.get("kv_transports", "").split(",") if n),
    )


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
