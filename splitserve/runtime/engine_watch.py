"""The engine loop's progress as part of a worker's liveness.

A worker's heartbeat says what load it carries, which it asks of its engine core; the core
answers between two turns of its loop. Waiting for that answer would tie the heartbeat to the
longest step (a long prefill chunk would look like a freeze), and never hearing it back is
exactly what a frozen loop looks like (SIGSTOPped core, a hung kernel or collective). So the
heartbeat never waits: `EngineWatch.latest` keeps one question in flight, answers with the
newest stats the core gave, and raises `Stalled` once the question has gone unanswered for
its deadline — the loop has not turned in that long, busy or idle (an idle loop answers
within its idle wait). `Presence` then takes the worker out of the registry until the core
answers.

The deadline is `stall_s` (`--engine-stall-s`) or, on a worker whose questions lately waited
long (a long step holds the answer until it ends), three times the longest such wait
(`runtime/pace.py`): a worker stepping ~1 s at a time on a busy CPU is not taken for a frozen
one at 2 s, while one stepping every 20 ms that freezes is caught at `stall_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from splitserve.engine.stats import EngineStats
from splitserve.kv_transfer.presence import Stalled
from splitserve.runtime.pace import DecayingPeak, paced


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
        self._answered_at: float | None = None  # when the question in flight was answered
        self._waits = DecayingPeak(clock=clock)  # how long answers took lately

    @property
    def pace_s(self) -> float:
        """The longest wait for an answer lately (decaying): about the loop's longest step
        under its load, which the worker advertises for the gateways' deadlines."""
        with self._lock:
            return self._waits.value()

    @property
    def deadline_s(self) -> float:
        """How long a question may go unanswered before the loop is taken for stalled."""
        return paced(self.stall_s, self._waits.value())

    def _ask_now(self, now: float) -> Future[Any]:
        pending = self._ask()
        self._pending, self._asked_at, self._answered_at = pending, now, None
        # NOTE: the answer's time, not the next heartbeat's: the wait the step really imposed
        pending.add_done_callback(self._answered)
        return pending

    def _answered(self, _: Future[Any]) -> None:
        self._answered_at = self._clock()

    def latest(self, first_timeout_s: float = 30.0) -> EngineStats:
        """The newest stats the core has answered with (the first call waits for them).

        Raises `Stalled` when the question in flight is older than `deadline_s`; the exception of
        a failed question (the core died) is raised as it is."""
        with self._lock:
            if self._pending is not None and self._pending.done():
                self._latest = _stats(self._pending.result())
                self._pending = None
                if self._answered_at is not None:
                    self._waits.observe(self._answered_at - self._asked_at)
            now = self._clock()
            pending = self._pending if self._pending is not None else self._ask_now(now)
            if self._latest is None:
                self._latest = _stats(pending.result(first_timeout_s))
                self._pending = None
                return self._latest
            waited = now - self._asked_at
            deadline_s = self.deadline_s
            if waited > deadline_s:
                raise Stalled(
                    f"its engine loop has not turned for {waited:.1f} s "
                    f"(--engine-stall-s {self.stall_s:g}, paced to {deadline_s:.1f} s)"
                )
            return self._latest


def _stats(reply: Any) -> EngineStats:
    return reply if isinstance(reply, EngineStats) else EngineStats(**reply)
