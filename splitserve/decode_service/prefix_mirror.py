"""A worker's prefix cache, mirrored into the registry's prefix index.

The gateway routes a prompt to the decode worker, and to the prefill worker, that already
caches most of its blocks (`Registry.prefix_match`). The engine core records each block hash
it adds to or evicts from its prefix cache; on every housekeeping turn the worker takes those
changes and publishes the last one of each hash, and every lease it drops the index entries of
workers that died without leaving. After Redis lost its data, everything still held is listed
again.
"""

from __future__ import annotations

import logging
import time

from splitserve.kv_transfer.registry import Registry
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
        self._changes: dict[bytes, bool] = {}  # changes not yet published: hash -> added
        self._held: set[bytes] = set()  # what the registry's prefix index should list
        # NOTE: a worker restarted under the same id holds none of the blocks its last life
        # indexed: routing must not prefer it for them.
        registry.clear_prefix_blocks(worker_id)

    def publish(self) -> None:
        """Publish the core's changes since the last call; sweep the dead workers' entries."""
        # NOTE: changes that could not be published (Redis unreachable) wait for the next turn.
        for added, block_hash in self.core.call("take_prefix_events"):
            self._changes[block_hash] = added  # only the last change of each hash matters
            (self._held.add if added else self._held.discard)(block_hash)
        added_hashes = [h for h, added in self._changes.items() if added]
        removed = [h for h, added in self._changes.items() if not added]
        if added_hashes:
            self.registry.add_prefix_blocks(self.worker_id, added_hashes)
        if removed:
            self.registry.remove_prefix_blocks(self.worker_id, removed)
        self._changes.clear()
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
        """After Redis lost its data: list again every block this worker holds."""
        self.registry.add_prefix_blocks(self.worker_id, list(self._held))

    def leave(self) -> None:
        self.registry.clear_prefix_blocks(self.worker_id)
