"""The registry's KV endpoints (`{ns}:kv_endpoint:{worker_id}`): what a worker publishes for its
KV peers, kept as long as it heartbeats. A decode worker publishes what senders need to reach
its receivers (`KVReceiver.endpoint`), a prefill worker what receivers know its senders by
(`KVSender.endpoint`). Sealed with the cluster secret, their access-granting fields encrypted
(registry_seal.py). Its worker is listed in `{ns}:kv_peers` while it is published: a worker out
of routing for a while (changing role: `Registry.withdraw_worker`) is still a KV peer. Part of
`Registry` (see registry.py for the key layout)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from splitserve.kv_transfer.registry_records import WORKER_KINDS, as_bytes, as_text, ms
from splitserve.kv_transfer.registry_seal import Seal


class KVEndpoints:
    """The KV-endpoint calls of `Registry`, over the registry's client, keys and seal."""

    _client: redis.Redis
    _ns: str
    _seal: Seal
    _written: dict[str, dict[str, bytes]]
    _live_workers: Any  # the script that reads hashes and prunes the ids of those gone

    def _endpoint_key(self, worker_id: str) -> str:
        return f"{self._ns}:kv_endpoint:{worker_id}"

    def _worker_key(self, kind: str, worker_id: str) -> str:
        return f"{self._ns}:worker:{kind}:{worker_id}"

    def _worker_set(self, kind: str) -> str:
        return f"{self._ns}:workers:{kind}"

    def _peers_set(self) -> str:
        return f"{self._ns}:kv_peers"

    def _publish_endpoint(self, worker_id: str, endpoint: Mapping[str, bytes], ttl_ms: int) -> None:
        key = self._endpoint_key(worker_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        sealed: dict[Any, Any] = self._seal.seal(key, endpoint)
        pipe.hset(key, mapping=sealed)
        pipe.pexpire(key, ttl_ms)
        pipe.sadd(self._peers_set(), worker_id)
        pipe.execute()
        self._written[key] = {as_text(k): as_bytes(v) for k, v in sealed.items()}

    def _open_endpoint(self, worker_id: str, raw: Mapping[Any, Any]) -> dict[str, bytes] | None:
        endpoint = {as_text(k): as_bytes(v) for k, v in raw.items()}
        if not endpoint:
            return None
        return self._seal.opened(self._endpoint_key(worker_id), endpoint)

    def kv_endpoint(self, worker_id: str) -> dict[str, bytes] | None:
        """What a live worker published for its KV peers (None if nothing, or if its record
        does not open: a wrong seal, a concealed field that does not decrypt)."""
        return self._open_endpoint(worker_id, self._client.hgetall(self._endpoint_key(worker_id)))

    def kv_endpoint_values(self, field: str) -> set[bytes]:
        """What live KV peers (workers of every kind, and those out of routing while they change
        role) published under endpoint `field` in records that open (sealed by a member): e.g.
        the agent names NIXL senders are known by."""
        pipe = self._client.pipeline(transaction=False)
        for kind in WORKER_KINDS:
            pipe.smembers(self._worker_set(kind))
        pipe.smembers(self._peers_set())
        ids = sorted({as_text(m) for members in pipe.execute() for m in members})
        if not ids:
            return set()
        # NOTE: one script (registry_lua.LIVE_WORKERS): peers whose endpoint lapsed are pruned
        keys = [self._peers_set()] + [self._endpoint_key(i) for i in ids]
        rows = self._live_workers(keys=keys, args=ids)
        values = set()
        for worker_id, row in zip(ids, rows, strict=True):
            raw = dict(zip(row[::2], row[1::2], strict=True))
            endpoint = self._open_endpoint(worker_id, raw)
            if endpoint is not None and field in endpoint:
                values.add(endpoint[field])
        return values

    def withdraw_worker(self, kind: str, worker_id: str) -> None:
        """Take a worker out of routing at once (nothing new is sent to it) while it stays a
        KV peer: its KV endpoint is kept (`keep_endpoint` keeps it alive), so what it still
        pushes is taken and what was reserved on it can still be pushed to."""
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._worker_key(kind, worker_id))
        pipe.srem(self._worker_set(kind), worker_id)
        pipe.execute()

    def keep_endpoint(
        self, worker_id: str, ttl_s: float, kv_endpoint: Mapping[str, bytes] | None
    ) -> None:
        """Extend the TTL of a withdrawn worker's KV endpoint (published again if Redis lost
        it): its heartbeat while it is out of routing."""
        if not kv_endpoint:
            return
        ttl_ms = ms(ttl_s, "ttl_s")
        pipe = self._client.pipeline(transaction=True)
        pipe.pexpire(self._endpoint_key(worker_id), ttl_ms)
        pipe.sadd(self._peers_set(), worker_id)
        kept, _ = pipe.execute()
        if not kept:
            self._publish_endpoint(worker_id, kv_endpoint, ttl_ms)
