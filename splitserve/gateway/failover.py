"""The gateway's failover settings (its deadlines on the calls to workers) and the workers
suspected of missing one (`gateway/migration.py` moves streams off them, `gateway/hedge.py`
hedges Reserves around them)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailoverSettings:
    # Abort: a healthy worker answers at once, so a silent one is given up on.
    rpc_timeout_s: float = 5.0
    # Reserve: a healthy worker answers within its longest step; one that does not is suspect,
    # and another is asked. Paced: three times the worker's recent peak wait, if longer
    # (runtime/pace.py), so a worker slow because busy is not taken for a frozen one.
    reserve_timeout_s: float = 1.0
    # A Reserve not answered this soon is also sent to another decode worker; the first answer
    # wins and the other is freed (gateway/hedge.py): a frozen worker delays a new request
    # about this much. Paced: twice the worker's recent peak Reserve answer if longer, at most
    # 1 s (or this, if longer). 0: off.
    reserve_hedge_s: float = 0.3
    # A Decode stream with no message for this long (paced, as reserve_timeout_s) is checked
    # (then every quarter of it): gone from the registry (heartbeat lapsed, or its engine
    # stalled) means it moves.
    stall_timeout_s: float = 1.0
    # How long a worker that missed a deadline gets no new request (while others are live), or
    # until it answers a Reserve in time (a hedge, or the only live worker's).
    suspect_s: float = 30.0
    # How many times one stream may move to another decode worker.
    max_migrations: int = 2
    # A HandOff (a moved stream's KV pushed by the worker that changes role) waits this long;
    # longer than that worker's own push timeout, so that it answers first.
    handoff_timeout_s: float = 90.0

    def __post_init__(self) -> None:
        positive = ("rpc_timeout_s", "reserve_timeout_s", "stall_timeout_s", "suspect_s")
        for name in (*positive, "handoff_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not (math.isfinite(self.reserve_hedge_s) and self.reserve_hedge_s >= 0):
            raise ValueError(f"reserve_hedge_s must be >= 0, got {self.reserve_hedge_s!r}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")


class Suspects:
    """Workers that missed a deadline lately; routing avoids them while another is live.

    NOTE: per gateway process, not shared with other replicas: each notices a silent worker
    itself (one missed deadline each), and a shared list would put a Redis call on every
    routing decision. `on_suspect(cause)` (if set) hears of each worker newly suspect, with
    the deadline it missed: reserve, stream or prefill (`splitserve:worker_suspicions`)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.on_suspect: Callable[[str], None] | None = None
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, worker_id: str, why: str, cause: str) -> None:
        with self._lock:
            known = self._until.get(worker_id, 0.0) > time.monotonic()
            self._until[worker_id] = time.monotonic() + self.hold_s
        if not known:
            log.warning("worker %s is suspect for %.0f s: %s", worker_id, self.hold_s, why)
            if self.on_suspect is not None:
                self.on_suspect(cause)

    def clear(self, worker_id: str) -> None:
        """`worker_id` answered a call in time: it is no longer suspect."""
        with self._lock:
            known = self._until.pop(worker_id, 0.0) > time.monotonic()
        if known:
            log.warning("worker %s answered in time: no longer suspect", worker_id)

    def current(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for worker_id in [w for w, until in self._until.items() if until <= now]:
                del self._until[worker_id]
            return set(self._until)
