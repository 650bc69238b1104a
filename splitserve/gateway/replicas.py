"""What gateway replicas share through Redis: who owns each running request id, so that `Abort`
and duplicate ids work from any replica (processes of one `--processes N`, or replicas behind a
Kubernetes Service).

    {ns}:gw:req:{owner}:{id}       "<replica>\\n<owner hash>" while it runs (PX lease, renewed by
                                   its replica); "ended" for `remember_s` after it ends. `owner`:
                                   the API key's principal, hashed (ids are scoped per key);
                                   without keys, `{ns}:gw:req:{id}`
    {ns}:gw:early:{owner}:{id}     an Abort that came before its Generate (PX remember_s)
    {ns}:gw:abort:{replica}        pub/sub channel: Aborts for the replica's requests
    {ns}:gw:reply:{nonce}          list: the owner's answer to one forwarded Abort
    {ns}:gw:alive:{replica}        while the replica lives (PX lease, renewed by it): what
                                   its shared prefill budgets count (gateway/prefill_ledger.py)

    client ──Abort(id)──▶ replica B ── GET req:id ─▶ "A…" ── PUBLISH abort:A ──▶ replica A
                              ▲                                                    │ cancels it
                              └───────────── BLPOP reply:nonce ◀── LPUSH ──────────┘

A claim and a release are one Lua call each (check and write atomically), per request; nothing
is sent per token. A replica that dies leaves its ids taken until their lease ends (`lease_s`):
each replica renews its own ids every lease_s / 3 in one pipeline. The owner is stored hashed:
an Abort from another API key finds nothing, as on one replica, and another key's request with
the same id is another key in Redis: neither refused (ALREADY_EXISTS) nor in the way.

If Redis cannot be reached a replica goes on alone (its own table still refuses its duplicates
and aborts its requests), trying Redis again a second later (`redis_breaker.py`): serving
beats refusing, and the registry is down anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import uuid
from collections.abc import Callable, Iterable

import redis

from splitserve.engine.errors import AlreadyExists, quoted
from splitserve.gateway.redis_breaker import Breaker

ENDED = b"ended"

# KEYS: req key, early-abort key. ARGV: value, lease ms, "<replica>\n". 1 if an early abort
# was waiting, 0 if not, -1 if the id runs elsewhere. A record of this replica's own is stale
# (its own table said the id is free: a release that Redis missed).
CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= 'ended' and string.sub(cur, 1, #ARGV[3]) ~= ARGV[3] then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('DEL', KEYS[2])
"""

# KEYS: req key. ARGV: value, remember ms. Only the claim's own value is ended.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], 'ended', 'PX', ARGV[2])
  return 1
end
return 0
"""


def owner_hash(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class SharedRequests:
    """This replica's side of the shared request table (see the module doc). Blocking calls
    (`claim`, `release`, `abort_elsewhere`) are for threads; `start` runs the Abort listener
    and the lease renewal."""

    def __init__(
        self,
        client: redis.Redis,
        replica_id: str,
        namespace: str = "splitserve",
        lease_s: float = 15.0,
        remember_s: float = 30.0,
        reply_timeout_s: float = 2.0,
        outage_retry_s: float = 1.0,
    ) -> None:
        self._client = client
        self.replica_id = replica_id
        self._ns = namespace
        self.lease_ms = int(lease_s * 1000)
        self.remember_ms = int(remember_s * 1000)
        self.reply_timeout_s = reply_timeout_s
        self._claim = client.register_script(CLAIM)
        self._release = client.register_script(RELEASE)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._breaker = Breaker("shared request ids", outage_retry_s)

    # -- keys ---------------------------------------------------------------------------------

    def _req_key(self, owner: str, request_id: str) -> str:
        if not owner:  # NOTE: no API keys: the one anonymous namespace
            return f"{self._ns}:gw:req:{request_id}"
        return f"{self._ns}:gw:req:{owner_hash(owner)}:{request_id}"

    def _early_key(self, owner: str, request_id: str) -> str:
        return f"{self._ns}:gw:early:{owner_hash(owner)}:{request_id}"

    def _channel(self, replica_id: str) -> str:
        return f"{self._ns}:gw:abort:{replica_id}"

    def _alive_key(self) -> str:
        return f"{self._ns}:gw:alive:{self.replica_id}"

    def _value(self, owner: str) -> str:
        return f"{self.replica_id}\n{owner_hash(owner)}"

    # -- per request (blocking) ---------------------------------------------------------------

    def claim(self, request_id: str, owner: str) -> bool:
        """Hold `request_id` for this replica; True if an Abort for it came first (from any
        replica). AlreadyExists if it runs on another replica."""
        if self._breaker.is_open:
            return False
        try:
            got = self._claim(
                keys=[self._req_key(owner, request_id), self._early_key(owner, request_id)],
                args=[self._value(owner), self.lease_ms, f"{self.replica_id}\n"],
            )
        except redis.RedisError as exc:
            self._unreachable(exc)
            return False
        self._breaker.answered()
        if got == -1:
            raise AlreadyExists(f"request id {quoted(request_id)} is already running")
        return bool(got)

    def release(self, request_id: str, owner: str) -> None:
        if self._breaker.is_open:
            return  # NOTE: the lease ends it
        try:
            self._release(
                keys=[self._req_key(owner, request_id)],
                args=[self._value(owner), self.remember_ms],
            )
        except redis.RedisError as exc:
            self._unreachable(exc)

    def abort_elsewhere(self, request_id: str, owner: str) -> bool:
        """Abort `owner`'s request `request_id` running on another replica: True if its owner
        replica stopped it. An id that runs nowhere (yet) is remembered for `remember_s`: its
        Generate, wherever it lands, then ends at once."""
        if self._breaker.is_open:
            return False
        try:
            value = self._client.get(self._req_key(owner, request_id))
            if value is None or value == ENDED:
                if value is None:
                    self._client.set(self._early_key(owner, request_id), b"1", px=self.remember_ms)
                return False
            text = value.decode() if isinstance(value, bytes) else str(value)
            replica, _, hashed = text.partition("\n")
            if hashed != owner_hash(owner) or replica == self.replica_id:
                return False  # NOTE: another key's request: to this caller it does not exist
            reply = f"{self._ns}:gw:reply:{uuid.uuid4().hex}"
            message = json.dumps({"id": request_id, "owner": owner, "reply": reply})
            if not self._client.publish(self._channel(replica), message):
                return False  # NOTE: nobody listens: that replica is gone
            answer = self._client.blpop([reply], timeout=self.reply_timeout_s)
        except redis.RedisError as exc:
            self._unreachable(exc)
            return False
        return answer is not None and answer[1] == b"1"

    # -- background ---------------------------------------------------------------------------

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        abort_local: Callable[[str, str], bool],
        running: Callable[[], Iterable[tuple[str, str]]],
    ) -> None:
        """Listen for Aborts forwarded to this replica (each run by `abort_local(id, owner)`
        on `loop`) and renew the leases of the requests `running()` lists as (owner, id) (read
        on `loop`), and of the replica itself."""
        try:
            self._client.set(self._alive_key(), b"1", px=self.lease_ms)
        except redis.RedisError as exc:
            self._unreachable(exc)
        for target, name in ((self._listen, "gw-aborts"), (self._renew, "gw-leases")):
            thread = threading.Thread(
                target=target, args=(loop, abort_local, running), name=name, daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5.0)
        # NOTE: its prefill tokens stop counting at once, not when the lease ends
        with contextlib.suppress(redis.RedisError):
            self._client.delete(self._alive_key())
        self._client.close()

    def _listen(self, loop, abort_local, running) -> None:  # noqa: ANN001 - see start
        pubsub = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self._channel(self.replica_id))
                message = pubsub.get_message(timeout=0.5)
                if message is not None:
                    self._answer(loop, abort_local, json.loads(message["data"]))
            except (redis.RedisError, OSError, ValueError) as exc:
                self._unreachable(exc)
                if pubsub is not None:
                    pubsub.close()
                pubsub = None
                self._stop.wait(0.5)
        if pubsub is not None:
            pubsub.close()

    def _answer(self, loop, abort_local, request: dict) -> None:  # noqa: ANN001 - see start
        async def abort() -> bool:
            return abort_local(request["id"], request["owner"])

        try:
            aborted = asyncio.run_coroutine_threadsafe(abort(), loop).result(5.0)
        except Exception:  # noqa: BLE001 - the asker times out; the loop may be stopping
            aborted = False
        pipe = self._client.pipeline(transaction=False)
        pipe.lpush(request["reply"], b"1" if aborted else b"0")
        pipe.pexpire(request["reply"], 10_000)
        pipe.execute()

    def _renew(self, loop, abort_local, running) -> None:  # noqa: ANN001 - see start
        async def snapshot() -> list[tuple[str, str]]:
            return list(running())

        while not self._stop.wait(self.lease_ms / 3000):
            try:
                ids = asyncio.run_coroutine_threadsafe(snapshot(), loop).result(5.0)
                pipe = self._client.pipeline(transaction=False)
                pipe.set(self._alive_key(), b"1", px=self.lease_ms)
                for owner, request_id in ids:
                    pipe.pexpire(self._req_key(owner, request_id), self.lease_ms)
                pipe.execute()
            except (redis.RedisError, OSError) as exc:
                self._unreachable(exc)
            except Exception:  # noqa: BLE001 - the loop is stopping
                return

    def _unreachable(self, exc: BaseException) -> None:
        self._breaker.failed(exc)
