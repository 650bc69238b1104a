"""Deadlines that scale with a worker's own pace.

A deadline that tells a frozen worker from a busy one can't be one number: a GPU worker steps
every few tens of milliseconds, a CPU worker at full batch with 2048-token chunks takes about a
second per step, and the same worker's steps vary with its load. So the failover deadlines
(the gateway's Reserve and stream deadlines, the worker's own engine-stall check) are

    deadline = min(CAP_FACTOR × floor, max(floor, PACE_FACTOR × recent peak))

where `floor` is the configured deadline (`--reserve-timeout-s`, `--stall-timeout-s`,
`--engine-stall-s`) and the recent peak is the longest wait lately observed on that worker (a
Reserve's answer, the gap between two messages of a Decode stream, the engine loop's answer to
a question), decaying by half every `HALF_LIFE_S` without a longer one. A worker stepping every
20 ms that freezes is caught at the floor; one whose steps legitimately take 1 s is not taken for
frozen before 3 s. Only waits that ended are observed, so a frozen worker never stretches its own
deadline while it is frozen; the cap bounds what a short freeze that ended can stretch it to.

The gateway's Reserve hedge is paced the same way, on its own peaks (Reserve answers only, with
HEDGE_FACTOR): a decode worker whose Reserves all take 0.5 s at full load is hedged after 1 s,
not after the 0.3 s floor, which would send nearly every Reserve twice just when the workers
have the least room for it. It waits at most HEDGE_CAP_S (or the floor, if longer), so a frozen
worker never delays a new request by more than that. And it counts from the last time the worker
was heard from (a Reserve answered, a stream message), not from the Reserve's send: a busy worker
answering others is slow, not frozen, and is not hedged while it keeps answering.

A gateway that has not yet waited on a worker (it just started, or the worker is new) has no
peak of its own for it. Each worker advertises its engine loop's recent peak wait in its
registry record (`pace_ms`, from `EngineWatch`), and the peak a deadline uses is the larger of
the two: a cold gateway does not take a worker stepping 1 s at a time for frozen at a 1 s floor.
A frozen worker's record keeps the pace it had before it froze, which the cap bounds as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PACE_FACTOR = 3.0  # a deadline is this many times the worker's recent peak wait, at least
HEDGE_FACTOR = 2.0  # a hedge waits this many times the worker's recent peak answer, at least
HEDGE_CAP_S = 1.0  # and at most this (or the flag, if longer): a frozen worker's cost
HALF_LIFE_S = 10.0  # a peak not seen again halves in this long
CAP_FACTOR = 10.0  # a paced deadline is at most this many times its floor


def paced(floor_s: float, peak_s: float, factor: float = PACE_FACTOR) -> float:
    """The deadline for a worker whose recent peak wait is `peak_s` (see the module doc)."""
    return min(CAP_FACTOR * floor_s, max(floor_s, factor * peak_s))


class DecayingPeak:
    """The longest wait observed lately: a longer one replaces it, and it halves every
    `half_life_s` without one. Not locked: each owner updates it from one thread (or loop)."""

    def __init__(
        self, half_life_s: float = HALF_LIFE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        self.half_life_s = half_life_s
        self._clock = clock
        self._peak = 0.0
        self._at = 0.0

    def value(self) -> float:
        """The peak now, decayed since it was seen."""
        if not self._peak:
            return 0.0
        return self._peak * 0.5 ** ((self._clock() - self._at) / self.half_life_s)

    def observe(self, seconds: float) -> None:
        if seconds > self.value():
            self._peak, self._at = seconds, self._clock()


class Paces:
    """A `DecayingPeak` per worker, and the paced deadline of each (see the module doc)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._peaks: dict[str, DecayingPeak] = {}
        self._heard: dict[str, float] = {}
        self._advertised: dict[str, float] = {}

    def observe(self, worker_id: str, seconds: float) -> None:
        """A wait on `worker_id` that ended after `seconds` (it was heard from just now)."""
        peak = self._peaks.get(worker_id)
        if peak is None:
            peak = self._peaks[worker_id] = DecayingPeak(clock=self._clock)
        peak.observe(seconds)
        self._heard[worker_id] = self._clock()

    def advertise(self, worker_id: str, peak_s: float) -> None:
        """The peak wait `worker_id` advertises for itself (its registry record's `pace_ms`),
        the least its peak is taken to be here."""
        self._advertised[worker_id] = peak_s

    def heard(self, worker_id: str) -> None:
        """`worker_id` answered something just now (it is not frozen)."""
        self._heard[worker_id] = self._clock()

    def last_heard(self, worker_id: str) -> float:
        """When `worker_id` last answered anything observed here (0.0: never)."""
        return self._heard.get(worker_id, 0.0)

    def peak(self, worker_id: str) -> float:
        peak = self._peaks.get(worker_id)
        seen = 0.0 if peak is None else peak.value()
        return max(seen, self._advertised.get(worker_id, 0.0))

    def hedge_delay(self, worker_id: str, floor_s: float) -> float:
        """How long a Reserve to `worker_id` waits before it is hedged (the module doc)."""
        return min(self.deadline(worker_id, floor_s, HEDGE_FACTOR), max(floor_s, HEDGE_CAP_S))

    def deadline(self, worker_id: str, floor_s: float, factor: float = PACE_FACTOR) -> float:
        """How long `worker_id` may keep a caller waiting before it is suspect (`factor`: of
        its recent peak wait)."""
        return paced(floor_s, self.peak(worker_id), factor)
