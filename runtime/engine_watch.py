"""The engine loop's progress as part of a worker's liveness.

A worker's heartbeat says what load it carries, which it asks of its engine core; the core
answers between two turns of its loop. Waiting for that answer would tie the heartbeat to the
longest step (a long prefill chunk would look like a freeze), and never hearing it back is
exactly what a frozen loop looks like (SIGSTOPped core, a hung kernel or collective). So the
heartbeat never waits: `EngineWatch.latest` keeps one question in flight, answers with the
newest stats the core gave, and raises `Stalled` once the question has gone unanswered for
`stall_s` — the loop has not turned in that long, busy or idle (an idle loop answers within
its idle wait). `Presence` then takes the worker out of the registry until the core answers.

`stall_s` (`--engine-stall-s`) must sit above the longest step the worker ever takes, which
`splitserve:step_seconds_max` and the step-time histogram report.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from splitserve.engine.stats import EngineStats
from splitserve.kv_transfer.presence import Stalled


class EngineWatch:
    """The newest stats of an engine core, asked for without waiting (see the module doc).

    `ask` sends one "stats" question to the core and returns its future (the reply's fields)."""

    def __init__(
        self,
        ask: Callable[[], Future[Any]],
        stall_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s!r}")
        self._ask = ask
        self.stall_s = stall_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: Future[Any] | None = None
        self._asked_at = 0.0
        self._latest: EngineStats | None = None

    def latest(self, first_timeout_s: float = 30.0) -> EngineStats:
        """The newest stats the core has answered with (the first call waits for them).

        Raises `Stalled` when the question in flight is older than `stall_s`; the exception of
        a failed question (the core died) is raised as it is."""
        with self._lock:
            if self._pending is not None and self._pending.done():
                self._latest = _stats(self._pending.result())
                self._pending = None
            now = self._clock()
            if self._pending is None:
                self._pending, self._asked_at = self._ask(), now
            if self._latest is None:
                self._latest = _stats(self._pending.result(first_timeout_s))
                self._pending = None
                return self._latest
            waited = now - self._asked_at
            if waited > self.stall_s:
                raise Stalled(
                    f"its engine loop has not turned for {waited:.1f} s "
                    f"(--engine-stall-s {self.stall_s:g})"
                )
            return self._latest


def _stats(reply: Any) -> EngineStats:
    return reply if isinstance(reply, EngineStats) else EngineStats(**reply)
