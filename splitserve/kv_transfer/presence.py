"""A worker's presence in the registry: registration and heartbeats with its current load on
one background thread, and a periodic housekeeping call on another (a housekeeping call that
waits on a long engine step never delays a heartbeat).

A draining worker (stopping, or changing role: splitserve/roles/switch.py) `step_aside`s: it is
out of routing at once (the gateway sends nothing new to it), but its heartbeats keep its KV
endpoint, so that it is still a KV peer for the pushes it finishes, and housekeeping (lease
renewal, reclaiming) goes on. It `leave`s the registry altogether at `stop`.

A heartbeat that finds the advertisement gone (Redis restarted empty, or the worker was frozen
past its TTL) registers again, KV endpoint included, and calls `on_rejoin` (e.g. to re-publish
the worker's prefix index). A heartbeat that finds its record changed by someone else (not what
it wrote last, e.g. with Redis's password but not the cluster secret) logs it and rewrites it
(`registry_own.py`). While Redis is unreachable the registry logs the outage once; the
heartbeats go on quietly.

A worker that can't serve although its process runs (its engine loop has not stepped for a
while: `runtime/engine_watch.py`) says so by raising `Stalled` from `info`: it leaves the
registry at once, so the gateway moves its streams and routes nothing new to it, and joins
again at the first heartbeat whose `info` answers. A frozen process can say nothing: its
record lapses after `ttl_s`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from splitserve.kv_transfer.registry import Registry, RegistryUnavailable, WorkerInfo

log = logging.getLogger(__name__)


class Stalled(Exception):
    """Raised by `info`: the worker can't serve now (e.g. its engine loop has not stepped)."""


class Presence:
    def __init__(
        self,
        registry: Registry,
        info: Callable[[], WorkerInfo],
        ttl_s: float = 3.0,
        interval_s: float = 0.5,
        on_tick: Callable[[], None] | None = None,
        kv_endpoint: Mapping[str, bytes] | None = None,
        on_rejoin: Callable[[], None] | None = None,
    ) -> None:
        if interval_s >= ttl_s:
            raise ValueError("the heartbeat interval must be shorter than the TTL")
        self.registry = registry
        self.info = info
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.on_tick = on_tick
        self.kv_endpoint = kv_endpoint
        self.on_rejoin = on_rejoin
        self._stop = threading.Event()
        self._kind = self._worker_id = ""
        self._left = False
        self._aside = False  # left routing only, a KV peer still (`RolePresence.step_aside`)
        self._lock = threading.Lock()  # NOTE: a heartbeat never re-registers after `leave`
        self._thread = threading.Thread(target=self._run, name="presence", daemon=True)
        self._housekeeper = threading.Thread(
            target=self._housekeep, name="housekeeping", daemon=True
        )
        self._rejoined = threading.Event()  # NOTE: on_rejoin runs on the housekeeping thread
        self._stalled = False

    def start(self) -> Presence:
        """Register and start heartbeating (nothing, if it left before it started: its worker
        died while starting)."""
        if self._left:
            return self
        first = self.info()
        self._kind, self._worker_id = first.kind, first.worker_id
        self.registry.register_worker(first, self.ttl_s, self.kv_endpoint)
        self._thread.start()
        self._housekeeper.start()
        return self

    def leave(self) -> None:
        """Leave the registry at once (not after the TTL); housekeeping goes on."""
        with self._lock:
            if self._left and not self._aside:
                return
            self._left, self._aside = True, False
            if not self._worker_id:
                return  # never registered
            try:
                self.registry.deregister_worker(self._kind, self._worker_id)
            except Exception:  # noqa: BLE001 - Redis may already be gone at shutdown
                log.warning("could not deregister %s", self._worker_id)

    def step_aside(self) -> None:
        """Out of routing at once (the gateway sends nothing new here), but still a KV peer:
        the KV endpoint stays, kept alive by the heartbeats, until `leave` (or `rejoin`).

        NOTE: a worker that drains (to stop, or to change role) still pushes KV (the prefills
        it finishes, the hand-offs of the streams it moves), and receivers take a push only
        from a sender whose endpoint a live peer published (kv_transfer/nixl_vetting.py); a
        prefill may still push into what was reserved here before. Without its endpoint, both
        would be refused."""
        with self._lock:
            if self._left:
                return
            self._left = self._aside = True
            if not self._worker_id:
                return  # never registered
            try:
                self.registry.withdraw_worker(self._kind, self._worker_id)
            except Exception:  # noqa: BLE001 - as `leave`: its record lapses after the TTL
                log.warning("could not take %s out of routing", self._worker_id)

    def stop(self) -> None:
        """Leave the registry (if not yet done) and stop the background thread."""
        self.leave()
        self._stop.set()
        self._thread.join(5.0)
        self._housekeeper.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self._lock:
                    if not self._left:
                        self._beat()
                    elif self._aside:
                        self.registry.keep_endpoint(self._worker_id, self.ttl_s, self.kv_endpoint)
            except RegistryUnavailable:
                pass  # NOTE: the registry logs the outage once; the next tick tries again
            except Exception:  # noqa: BLE001 - keep beating through anything else
                log.exception("heartbeat failed")

    def _housekeep(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self._rejoined.is_set() and self.on_rejoin is not None:
                    self._rejoined.clear()
                    self.on_rejoin()
                if self.on_tick is not None:
                    self.on_tick()
            except RegistryUnavailable:
                pass
            except Exception:  # noqa: BLE001 - keep housekeeping through anything else
                log.exception("housekeeping failed")

    def _beat(self) -> None:
        try:
            info = self.info()
        except Stalled as why:
            if not self._stalled:
                self._stalled = True
                log.warning("%s leaves the registry until it serves: %s", self._worker_id, why)
                self.registry.deregister_worker(self._kind, self._worker_id)
            return
        if self._stalled:
            self._stalled = False
            log.warning("%s serves again; it rejoins the registry", info.worker_id)
        elif self.registry.heartbeat(info, self.ttl_s):
            return
        else:
            log.warning("%s was missing from the registry; registering again", info.worker_id)
        self.registry.register_worker(info, self.ttl_s, self.kv_endpoint)
        self._rejoined.set()
