"""The registry's prefix index: which workers hold which KV blocks in their prefix caches (by
the blocks' chained hashes), so the gateway can route a prompt to a worker that holds its start.
Part of `Registry` (see registry.py for the key layout)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import redis


class PrefixIndex:
    """The prefix-index calls of `Registry`, over the registry's client and keys."""

    _client: redis.Redis
    _ns: str
    _clear_prefix: Any  # the CLEAR_PREFIX script

    def _prefix_key(self, hash_hex: str) -> str:
        return f"{self._ns}:prefix:{hash_hex}"

    def _prefix_worker_key(self, worker_id: str) -> str:
        return f"{self._ns}:prefix_worker:{worker_id}"

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

    def prefix_index_workers(self) -> set[str]:
        """Ids of the workers that have entries in the prefix index."""
        head = self._prefix_worker_key("")
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*"
        keys = self._client.scan_iter(match=pattern, count=1000)
        return {(k.decode() if isinstance(k, bytes) else str(k))[len(head) :] for k in keys}

    def drop_stale_prefix_blocks(self, live_worker_ids: Collection[str]) -> list[str]:
        """Clear the prefix entries of every worker not in `live_worker_ids` (it died, or
        stopped answering, without leaving): routing must not prefer it. Returns their ids."""
        stale = sorted(self.prefix_index_workers() - set(live_worker_ids))
        for worker_id in stale:
            self.clear_prefix_blocks(worker_id)
        return stale

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
                worker = m.decode() if isinstance(m, bytes) else str(m)
                if matched.get(worker, 0) == i:
                    matched[worker] = i + 1
        return matched


def _hex(block_hash: bytes) -> str:
    if not isinstance(block_hash, bytes) or not block_hash:
        raise TypeError(f"block hashes must be non-empty bytes, got {block_hash!r}")
    return block_hash.hex()
