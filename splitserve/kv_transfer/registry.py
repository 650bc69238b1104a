"""The Redis block-ownership registry: worker discovery, per-request block records, prefix index.

Key layout, everything under `{ns}:` (the namespace)::

    {ns}:fence                      string  the last fence issued (microseconds, see registry_lua)
    {ns}:since                      string  the first fence issued since Redis (re)started empty
    {ns}:workers:{kind}             set     ids of workers of that kind (pruned lazily)
    {ns}:worker:{kind}:{worker_id}  hash    WorkerInfo fields; PEXPIRE = heartbeat TTL
    {ns}:kv_endpoint:{worker_id}    hash    what its KV peers need (registry_endpoints); same TTL
    {ns}:kv_peers                   set     ids of workers with a KV endpoint (pruned lazily)
    {ns}:req:{request_id}           hash    state, owner, writer, fence, blocks; PEXPIRE = lease
    {ns}:prefix:{hash_hex}          set     ids of workers holding that block in their prefix cache
    {ns}:prefix_worker:{worker_id}  set     hash_hex of every block that worker holds
    {ns}:index_events               stream  the prefix index's changes, trimmed (prefix_events)
    (a worker's host-memory KV tier is indexed under the id "{worker_id}@host": registry_prefix)

A request's record goes through::

    reserve(D) ─▶ reserved ─begin_write(P, fence)─▶ writing ─handoff(D, fence)─▶ owned
                     └──────────────── handoff(D, fence) ──────────────────────────┘
    release(fence) deletes it from any state; a lease that is not renewed deletes it on its own.

NOTE: every step that reads then writes a record is one Lua script, so checks and updates can
never interleave with another client's. A fence is issued by `reserve` only, and the fence is
never reused, across Redis restarts too: whoever holds an older fence is refused by every later
step. Every call is safe to repeat (a reserve carries a nonce that finds its own earlier
attempt), so calls that meet a lost connection retry (registry_retry.py). A record Redis lost
in a restart is re-published by the worker that holds it (`restore`); meanwhile a step on it
raises RecordLost (UNAVAILABLE) after its retries, never StaleFenceError.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from splitserve.kv_transfer import registry_lua as lua
from splitserve.kv_transfer.registry_endpoints import KVEndpoints
from splitserve.kv_transfer.registry_own import OwnRecords, stored
from splitserve.kv_transfer.registry_prefix import PrefixIndex
from splitserve.kv_transfer.registry_records import (
    RECORD_STATES,
    WORKER_KINDS,
    BlockRecord,
    BlockSizeMismatch,
    RegistryError,
    RegistryUnavailable,
    Reservation,
    StaleFenceError,
    WorkerInfo,
    as_bytes,
    as_text,
    check_compatible,
    check_step,
    ms,
    worker_from_fields,
)
from splitserve.kv_transfer.registry_retry import Outage, call, retrying
from splitserve.kv_transfer.registry_seal import Seal

__all__ = [
    "RECORD_STATES",
    "WORKER_KINDS",
    "BlockRecord",
    "BlockSizeMismatch",
    "Registry",
    "RegistryError",
    "RegistryUnavailable",
    "Reservation",
    "StaleFenceError",
    "WorkerInfo",
]


PATIENT = ("register_worker", "kv_endpoint", "live_workers", "reserve", "begin_write", "handoff")


@retrying(patient=(*PATIENT, "get_record", "prefix_match", "prefix_match_tiers"), own=("reserve",))
class Registry(PrefixIndex, KVEndpoints, OwnRecords):
    """Who owns which KV blocks, which workers are alive, and which prefixes they hold.

    A call on a request's path retries through a Redis outage for up to `retry_s` seconds,
    then raises RegistryUnavailable."""

    def __init__(
        self, url: str, namespace: str = "splitserve", retry_s: float = 5.0, secret: str = ""
    ) -> None:
        """`secret`: the cluster secret; workers' records are sealed with it (their fields that
        grant access encrypted) when written, and ignored when read if they do not open
        (registry_seal.py)."""
        # NOTE: no retries inside redis-py: ours are per registry call, with a time budget.
        client = redis.Redis.from_url(
            url, socket_connect_timeout=2.0, socket_timeout=5.0, retry=Retry(NoBackoff(), 0)
        )
        self._setup(client, namespace, retry_s, secret)

    @classmethod
    def from_client(
        cls, client: redis.Redis, namespace: str = "splitserve", retry_s: float = 5.0
    ) -> Registry:
        """A registry over an existing client (which the caller keeps and closes)."""
        registry = cls.__new__(cls)
        registry._setup(client, namespace, retry_s)
        return registry

    def _setup(self, client: redis.Redis, namespace: str, retry_s: float, secret: str = "") -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty")
        if not math.isfinite(retry_s) or retry_s < 0:
            raise ValueError(f"retry_s must be a finite number of seconds >= 0, got {retry_s!r}")
        self._client = client
        self._ns = namespace
        self._seal = Seal(secret)
        # What this registry last wrote under each of its worker's own keys (as stored): a
        # heartbeat that finds something else there rewrites it (`_advertise`).
        self._written: dict[str, dict[str, bytes]] = {}
        self._retry_s = retry_s
        self._outage = Outage()
        self._reserve = client.register_script(lua.RESERVE)
        self._begin_write = client.register_script(lua.BEGIN_WRITE)
        self._handoff = client.register_script(lua.HANDOFF)
        self._renew = client.register_script(lua.RENEW)
        self._release = client.register_script(lua.RELEASE)
        self._live_workers = client.register_script(lua.LIVE_WORKERS)
        self._clear_prefix = client.register_script(lua.CLEAR_PREFIX)
        self._match_tiers_script = client.register_script(lua.MATCH_TIERS)
        self._restore = client.register_script(lua.RESTORE)

    @property
    def namespace(self) -> str:
        return self._ns

    def close(self) -> None:
        """Close the underlying client's connections."""
        self._client.close()

    # -- keys ---------------------------------------------------------------------------------

    def _req_key(self, request_id: str) -> str:
        if not request_id:
            raise ValueError("request_id must be non-empty")
        return f"{self._ns}:req:{request_id}"

    def _since_key(self) -> str:
        return f"{self._ns}:since"

    # -- workers ------------------------------------------------------------------------------

    def register_worker(
        self, info: WorkerInfo, ttl_s: float, kv_endpoint: Mapping[str, bytes] | None = None
    ) -> None:
        """Join: check that `info` agrees with the live workers, then advertise it, with what
        its KV peers need (`kv_endpoint`, kept as long as it heartbeats; its `Concealed`
        values encrypted at rest).

        Raises BlockSizeMismatch if a live worker uses another block size: KV blocks move
        between workers whole, and the gateway's prefix hashes are per block.
        """
        if info.block_size:
            for kind in WORKER_KINDS:
                for other in self.live_workers(kind):
                    check_compatible(info, other)
        if kv_endpoint:
            self._publish_endpoint(info.worker_id, kv_endpoint, ms(ttl_s, "ttl_s"))
        self._advertise(info, ttl_s)

    def _advertise(self, info: WorkerInfo, ttl_s: float) -> bool:
        ttl_ms = ms(ttl_s, "ttl_s")
        key = self._worker_key(info.kind, info.worker_id)
        endpoint_key = self._endpoint_key(info.worker_id)
        plain = {f.name: str(getattr(info, f.name)).encode() for f in fields(info)}
        plain["kv_transports"] = ",".join(info.kv_transports).encode()
        plain["adapters"] = json.dumps(list(info.adapters)).encode()  # names may hold commas
        mapping: dict[Any, bytes] = self._seal.seal(key, plain)
        pipe = self._client.pipeline(transaction=True)
        pipe.hgetall(key)
        pipe.delete(key)  # NOTE: rewritten whole: a field someone else added goes too
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, ttl_ms)
        pipe.hgetall(endpoint_key)
        pipe.pexpire(endpoint_key, ttl_ms)
        pipe.sadd(self._worker_set(info.kind), info.worker_id)
        if endpoint_key in self._written:
            pipe.sadd(self._peers_set(), info.worker_id)
        before, _, _, _, endpoint, *_ = pipe.execute()
        previous, self._written[key] = self._written.get(key), stored(mapping)
        if before and previous is not None:  # NOTE: written here before: still its own?
            self._check_own(key, before, previous, endpoint_key, endpoint, ttl_ms)
        return bool(before)

    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> bool:
        """Refresh the worker's advertisement (load, free blocks) and extend its TTL; False if
        it had lapsed (or Redis lost it): then the worker should `register_worker` again."""
        return self._advertise(info, ttl_s)

    def deregister_worker(self, kind: str, worker_id: str) -> None:
        """Withdraw a worker at once (a clean shutdown); its prefix index is left to the caller."""
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._worker_key(kind, worker_id))
        pipe.delete(self._endpoint_key(worker_id))
        pipe.srem(self._worker_set(kind), worker_id)
        pipe.srem(self._peers_set(), worker_id)
        pipe.execute()

    def live_workers(self, kind: str) -> list[WorkerInfo]:
        """Workers of `kind` whose advertisement has not expired, sorted by id.

        Ids whose advertisement expired are pruned from the kind's set on the way.
        """
        ids = sorted(as_text(m) for m in self._client.smembers(self._worker_set(kind)))
        if not ids:
            return []
        keys = [self._worker_set(kind)] + [self._worker_key(kind, i) for i in ids]
        rows = self._live_workers(keys=keys, args=ids)
        live = []
        for worker_id, row in zip(ids, rows, strict=True):
            if row:
                stored = {as_text(k): as_bytes(v) for k, v in zip(row[::2], row[1::2], strict=True)}
                record = self._seal.opened(self._worker_key(kind, worker_id), stored)
                if record is not None:
                    live.append(worker_from_fields({k: as_text(v) for k, v in record.items()}))
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
        lease_ms = ms(lease_s, "lease_s")
        key = self._req_key(request_id)
        # NOTE: one nonce for every attempt: a retry finds the record its own earlier attempt
        # made (whose reply was lost) instead of failing as a duplicate.
        args: list[str | int] = [decode_worker, json.dumps(blocks), lease_ms, int(replace)]
        args += [time.time_ns() // 1000, uuid.uuid4().hex]
        keys = [key, f"{self._ns}:fence", self._since_key()]
        attempt = lambda: self._reserve(keys=keys, args=args)  # noqa: E731
        created, value = call(attempt, self._retry_s, self._outage)
        if not created:
            raise RegistryError(
                f"request {request_id!r} already has a block record (state {as_text(value)!r}); "
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
            keys=[self._req_key(request_id), self._since_key()],
            args=[prefill_worker, int(fence), ms(lease_s, "lease_s")],
        )
        check_step("begin_write", request_id, fence, as_text(status), as_text(detail))

    def handoff(
        self,
        request_id: str,
        decode_worker: str,
        fence: int,
        lease_s: float,
        held: Sequence[int] | None = None,
    ) -> bool:
        """Make `decode_worker` (the worker that reserved the blocks) their owner.

        The owned record keeps a lease, which the decode worker renews while it decodes, so a
        crashed decode worker's record lapses too. Idempotent for the same owner and fence.
        `held`: the blocks, when the caller still holds its reservation of them (nothing freed
        them: only their holder releases a record): a record whose lease lapsed meanwhile (a
        host too busy to send the Decode within the lease) is then written again, owned, and
        True is returned. Raises StaleFenceError if the record is gone (and not `held`) or
        carries another fence, and RegistryError if `decode_worker` did not reserve the blocks.
        """
        status, detail = self._handoff(
            keys=[self._req_key(request_id), self._since_key()],
            args=[
                decode_worker,
                int(fence),
                ms(lease_s, "lease_s"),
                "" if held is None else json.dumps(list(held)),
            ],
        )
        status = as_text(status)
        if status == "rewritten":
            return True
        check_step("handoff", request_id, fence, status, as_text(detail))
        return False

    def renew(self, request_id: str, fence: int, lease_s: float) -> bool:
        """Extend the lease; False if the record is gone or carries another fence."""
        return not self.renew_many({request_id: fence}, lease_s)

    def renew_many(self, fences: Mapping[str, int], lease_s: float) -> set[str]:
        """`renew` each request's record (id -> its fence) in one round trip; the ids of those
        not renewed."""
        ids = list(fences)
        if not ids:
            return set()
        args = [ms(lease_s, "lease_s"), *(int(fences[r]) for r in ids)]
        lost = self._renew(keys=[self._req_key(r) for r in ids], args=args)
        return {ids[int(i) - 1] for i in lost}

    def release(self, request_id: str, fence: int | None = None) -> bool:
        """Delete the record (only if it carries `fence`, when given); True if it was deleted."""
        key = self._req_key(request_id)
        if fence is None:
            return bool(self._client.delete(key))
        return bool(self._release(keys=[key], args=[int(fence)]))

    def release_quietly(self, request_id: str, fence: int | None = None) -> None:
        """`release`, except that an unreachable Redis is not an error: the record lapses with
        its lease (for a request ending whose last message may be out already)."""
        with contextlib.suppress(RegistryUnavailable):
            self.release(request_id, fence)

    def get_record(self, request_id: str) -> BlockRecord | None:
        """The request's record, or None if it has none (never reserved, released or expired)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hgetall(self._req_key(request_id))
        pipe.pttl(self._req_key(request_id))
        raw, ttl = pipe.execute()
        if not raw:
            return None
        rec = {as_text(k): as_text(v) for k, v in raw.items()}
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

    def restore(
        self, records: Iterable[BlockRecord], lease_s: float, after: int = 0
    ) -> tuple[int, int]:
        """Re-publish the records a worker holds that Redis lost in a restart (never one that
        was released or whose lease lapsed), each with a fresh lease. `after` is the mark this
        returned last time (0 at first): nothing is done while it is current. Returns the
        current mark and how many records were re-published."""
        args: list[str | int] = [ms(lease_s, "lease_s"), int(after)]
        keys = [self._since_key()]
        for r in records:
            args += [r.state, r.owner, int(r.fence), json.dumps(list(r.block_ids))]
            keys.append(self._req_key(r.request_id))
        since, restored = self._restore(keys=keys, args=args)
        return int(since), int(restored)

    def request_record_keys(self) -> list[str]:
        """Every request record key in this namespace (SCAN; for leak checks, not hot paths)."""
        pattern = f"{_glob_escape(self._ns)}:req:*"
        return sorted(as_text(k) for k in self._client.scan_iter(match=pattern, count=1000))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
