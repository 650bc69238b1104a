"""A worker's prefix cache, mirrored into the registry's prefix index.

The gateway routes a prompt to the decode worker, and to the prefill worker, that already
caches most of its blocks (`Registry.prefix_match`). The engine core records each block hash
it adds to or evicts from its prefix cache; on every housekeeping turn the worker takes those
changes and publishes the last one of each hash, and every lease it drops the index entries of
workers that died without leaving. After Redis lost its data, everything still held is listed
again.

A worker's host-memory KV tier (engine/host_index.py) is mirrored the same way, under its own
index id (`host_tier_id`), so the gateway can weigh a host block below a GPU block.
"""

from __future__ import annotations

import logging
import time

from splitserve.engine.host_index import GPU_TIER, HOST_TIER
from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.registry_prefix import host_tier_id
from splitserve.runtime.engine_core.client import EngineCoreClient

log = logging.getLogger(__name__)


class PrefixMirror:
    """The registry's prefix index for one worker (used from the heartbeat thread)."""

    def __init__(
        self, core: EngineCoreClient, registry: Registry, worker_id: str, sweep_s: float
    ) -> None:
        self.core = core
        self.registry = registry
        self.worker_id = worker_id
        self.sweep_s = sweep_s
        self._next_sweep = 0.0
        # The index id of each tier's blocks: the worker's own, and its host tier's.
        self._ids = {GPU_TIER: worker_id, HOST_TIER: host_tier_id(worker_id)}
        # Per tier: changes not yet published (hash -> added), and what the index should list.
        self._changes: dict[str, dict[bytes, bool]] = {tier: {} for tier in self._ids}
        self._held: dict[str, set[bytes]] = {tier: set() for tier in self._ids}
        # NOTE: a worker restarted under the same id holds none of the blocks its last life
        # indexed (in either tier): routing must not prefer it for them.
        registry.clear_prefix_blocks(worker_id)

    def publish(self) -> None:
        """Publish the core's changes since the last call; sweep the dead workers' entries."""
        # NOTE: changes that could not be published (Redis unreachable) wait for the next turn.
        for added, block_hash, tier in self.core.call("take_prefix_events"):
            self._changes[tier][block_hash] = added  # only the last change of each hash matters
            (self._held[tier].add if added else self._held[tier].discard)(block_hash)
        for tier, changes in self._changes.items():
            added_hashes = [h for h, added in changes.items() if added]
            removed = [h for h, added in changes.items() if not added]
            if added_hashes:
                self.registry.add_prefix_blocks(self._ids[tier], added_hashes)
            if removed:
                self.registry.remove_prefix_blocks(self._ids[tier], removed)
            changes.clear()
        self._sweep()

    def _sweep(self) -> None:
        """Drop the prefix entries of workers that died without leaving (every lease)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_s
        kinds = ("decode", "colocated", "prefill")
        live = [w.worker_id for k in kinds for w in self.registry.live_workers(k)]
        for worker_id in self.registry.drop_stale_prefix_blocks([*live, self.worker_id]):
            log.warning("dropped the prefix index of %s: it is gone", worker_id)

    def republish(self) -> None:
        """After Redis lost its data: list again every block this worker holds (both tiers)."""
        for tier, held in self._held.items():
            self.registry.add_prefix_blocks(self._ids[tier], list(held))

    def leave(self) -> None:
        """Drop this worker's entries, its host tier's too."""
        self.registry.clear_prefix_blocks(self.worker_id)
