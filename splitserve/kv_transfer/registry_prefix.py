"""The registry's prefix index: which workers hold which KV blocks in their prefix caches (by
the blocks' chained hashes), so the gateway can route a prompt to a worker that holds its start.
Part of `Registry` (see registry.py for the key layout).

A worker's host-memory KV tier is indexed apart, under the id `host_tier_id(worker)`
("<worker>@host"), since a block there is worth less than one on the GPU (it must be copied
back first): `prefix_match_tiers` tells the two apart. That id belongs to its worker: cleared
with it, never swept while it is live.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import redis

from splitserve.kv_transfer import prefix_events
from splitserve.kv_transfer.prefix_events import ADD, CLEAR, REMOVE

# The suffix of a worker's host-tier id in the prefix index.
# NOTE: defined here only; a worker id ending in it would be taken for a host tier.
HOST_TIER_SUFFIX = "@host"


def host_tier_id(worker_id: str) -> str:
    """The prefix-index id under which `worker_id`'s host-memory tier is listed."""
    return worker_id + HOST_TIER_SUFFIX


def index_owner(index_id: str) -> str:
    """The worker a prefix-index id belongs to (itself, or the worker of a host-tier id)."""
    return index_id.removesuffix(HOST_TIER_SUFFIX)


class PrefixIndex:
    """The prefix-index calls of `Registry`, over the registry's client and keys."""

    _client: redis.Redis
    _ns: str
    _clear_prefix: Any  # the CLEAR_PREFIX script
    _match_tiers_script: Any  # the MATCH_TIERS script

    def _prefix_key(self, hash_hex: str) -> str:
        return f"{self._ns}:prefix:{hash_hex}"

    def _prefix_worker_key(self, worker_id: str) -> str:
        return prefix_events.worker_key(self._ns, worker_id)

    def add_prefix_blocks(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Record that `worker_id` holds these blocks in its prefix cache (and log it)."""
        self._change_prefix_blocks(ADD, worker_id, hashes)

    def remove_prefix_blocks(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Record that `worker_id` evicted these blocks from its prefix cache (and log it)."""
        self._change_prefix_blocks(REMOVE, worker_id, hashes)

    def _change_prefix_blocks(self, op: str, worker_id: str, hashes: Iterable[bytes]) -> None:
        raw = list(hashes)
        hexes = [_hex(h) for h in raw]
        if not hexes:
            return
        # NOTE: one MULTI: the sets and the change log (prefix_events.py) never disagree.
        pipe = self._client.pipeline(transaction=True)
        update = pipe.sadd if op == ADD else pipe.srem
        for h in hexes:
            update(self._prefix_key(h), worker_id)
        update(self._prefix_worker_key(worker_id), *hexes)
        prefix_events.append(pipe, self._ns, op, worker_id, raw)
        pipe.execute()

    def clear_prefix_blocks(self, worker_id: str) -> int:
        """Remove every prefix entry of `worker_id`, its host tier's too (it restarted, left or
        died), and log it; returns how many. One script: both go at once."""
        ids = [worker_id, host_tier_id(worker_id)]
        pipe = self._client.pipeline(transaction=True)
        self._clear_prefix(
            keys=[self._prefix_worker_key(i) for i in ids],
            args=[self._prefix_key(""), *ids],
            client=pipe,
        )
        prefix_events.append(pipe, self._ns, CLEAR, worker_id)
        removed, _ = pipe.execute()
        return int(removed)

    def prefix_index_workers(self) -> set[str]:
        """Ids of the workers that have entries in the prefix index (of either tier)."""
        head = self._prefix_worker_key("")
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*"
        keys = self._client.scan_iter(match=pattern, count=1000)
        return {
            index_owner((k.decode() if isinstance(k, bytes) else str(k))[len(head) :]) for k in keys
        }

    def drop_stale_prefix_blocks(self, live_worker_ids: Collection[str]) -> list[str]:
        """Clear the prefix entries (both tiers') of every worker not in `live_worker_ids` (it
        died, or stopped answering, without leaving): routing must not prefer it. Returns
        their ids."""
        stale = sorted(self.prefix_index_workers() - set(live_worker_ids))
        for worker_id in stale:
            self.clear_prefix_blocks(worker_id)
        return stale

    def prefix_match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each worker, how many leading blocks of the hash chain it holds consecutively in
        its GPU prefix cache (host tiers not counted: `prefix_match_tiers`).

        Workers holding none of the leading block are left out. One round trip.
        """
        return {w: gpu for w, (gpu, _) in self._match_tiers(hashes).items() if gpu}

    def prefix_match_tiers(self, hashes: Sequence[bytes]) -> dict[str, tuple[int, int]]:
        """For each worker, (how many leading blocks of the hash chain it holds consecutively
        on its GPU, how many it can reuse in all: those, then the ones right after them that
        its host tier holds consecutively), as the engine's prefix lookup takes them.

        Workers holding the leading block in neither tier are left out. One round trip.
        """
        return self._match_tiers(hashes)

    def _match_tiers(self, hashes: Sequence[bytes]) -> dict[str, tuple[int, int]]:
        hexes = [_hex(h) for h in hashes]
        if not hexes:
            return {}
        # NOTE: walked server-side (registry_lua.MATCH_TIERS): it stops where no worker's run
        # can go on, so a 32k-token miss is one set read, not 2,048.
        width = len(hexes[0])
        if any(len(h) != width for h in hexes):
            raise ValueError("the block hashes of one chain must all be the same length")
        chain = "".join(hexes)
        flat = self._match_tiers_script(args=[self._prefix_key(""), HOST_TIER_SUFFIX, chain, width])
        matched: dict[str, tuple[int, int]] = {}
        for i in range(0, len(flat), 3):
            worker = flat[i].decode() if isinstance(flat[i], bytes) else str(flat[i])
            matched[worker] = (int(flat[i + 1]), int(flat[i + 2]))
        return matched


def _hex(block_hash: bytes) -> str:
    if not isinstance(block_hash, bytes) or not block_hash:
        raise TypeError(f"block hashes must be non-empty bytes, got {block_hash!r}")
    return block_hash.hex()
