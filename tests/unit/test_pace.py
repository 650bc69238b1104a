"""The pace rule (runtime/pace.py): a deadline is max(floor, 3 × the worker's recent peak wait),
at most 10 × the floor, and the peak halves every 10 s that no longer wait is seen."""

from __future__ import annotations

import pytest

from splitserve.runtime.pace import (
    CAP_FACTOR,
    HALF_LIFE_S,
    HEDGE_CAP_S,
    HEDGE_FACTOR,
    PACE_FACTOR,
    DecayingPeak,
    Paces,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_never_seen_or_fast_gets_the_floor():
    paces = Paces(clock=Clock())
    assert paces.deadline("gpu", 1.0) == 1.0
    for _ in range(50):
        paces.observe("gpu", 0.02)  # a GPU step
    assert paces.deadline("gpu", 1.0) == 1.0


def test_a_worker_whose_steps_take_a_second_gets_three_seconds_and_no_other_worker_does():
    paces = Paces(clock=Clock())
    paces.observe("cpu", 0.4)
    paces.observe("cpu", 1.0)
    paces.observe("cpu", 0.3)  # shorter waits do not lower the peak
    assert PACE_FACTOR == 3.0
    assert paces.deadline("cpu", 1.0) == pytest.approx(3.0)
    assert paces.deadline("gpu", 1.0) == 1.0


def test_the_peak_halves_every_half_life_without_a_longer_wait():
    clock = Clock()
    peak = DecayingPeak(clock=clock)
    peak.observe(1.0)
    clock.now += HALF_LIFE_S
    assert peak.value() == pytest.approx(0.5)
    peak.observe(0.4)  # below the decayed peak: no change
    clock.now += HALF_LIFE_S
    assert peak.value() == pytest.approx(0.25)
    peak.observe(0.6)
    assert peak.value() == pytest.approx(0.6)


def test_a_long_wait_stretches_the_deadline_at_most_to_the_cap():
    paces = Paces(clock=Clock())
    paces.observe("once-frozen", 60.0)
    assert paces.deadline("once-frozen", 1.0) == CAP_FACTOR * 1.0


def test_the_hedge_waits_twice_a_busy_workers_recent_answers_and_the_floor_for_a_quick_one():
    """The Reserve hedge's pace (gateway/hedge.py): the floor, twice the recent peak, at most
    1 s unless the floor is longer."""
    paces = Paces(clock=Clock())
    paces.observe("busy", 0.5)
    paces.observe("quick", 0.01)
    assert HEDGE_FACTOR == 2.0
    assert paces.hedge_delay("busy", 0.3) == pytest.approx(1.0)
    assert paces.hedge_delay("quick", 0.3) == pytest.approx(0.3)
    paces.observe("busy", 5.0)  # an answer from a worker that was frozen, once it went on
    assert paces.hedge_delay("busy", 0.3) == pytest.approx(HEDGE_CAP_S)  # never past 1 s
    assert paces.hedge_delay("busy", 2.0) == pytest.approx(2.0)  # a flag above 1 s: the flag


def test_a_worker_is_heard_from_when_a_wait_on_it_ends_or_it_answers():
    clock = Clock()
    paces = Paces(clock=clock)
    assert paces.last_heard("d0") == 0.0
    paces.observe("d0", 0.2)
    assert paces.last_heard("d0") == clock.now
    clock.now += 5
    paces.heard("d0")
    assert paces.last_heard("d0") == clock.now
    assert paces.last_heard("d1") == 0.0


def test_a_cold_gateway_paces_a_worker_by_the_peak_it_advertises():
    """A gateway that has not waited on a worker yet takes the worker's own advertised peak
    (its record's pace_ms): one stepping 1 s at a time gets 3 s, not the 1 s floor; its hedge
    waits twice that, at most 1 s. What the gateway observes itself counts when longer."""
    paces = Paces(clock=Clock())
    paces.advertise("cpu", 1.0)
    paces.advertise("gpu", 0.0)  # a record from a worker that does not say
    assert paces.deadline("cpu", 1.0) == pytest.approx(3.0)
    assert paces.deadline("gpu", 1.0) == 1.0
    assert paces.hedge_delay("cpu", 0.3) == pytest.approx(HEDGE_CAP_S)
    paces.observe("cpu", 2.0)
    assert paces.deadline("cpu", 1.0) == pytest.approx(6.0)
    paces.advertise("cpu", 0.1)  # its steps got short again
    assert paces.deadline("cpu", 1.0) == pytest.approx(6.0)  # the gateway's own peak still holds
    paces.advertise("frozen-once", 60.0)
    assert paces.deadline("frozen-once", 1.0) == CAP_FACTOR * 1.0


def test_the_half_life_must_be_positive():
    with pytest.raises(ValueError, match="half_life_s"):
        DecayingPeak(half_life_s=0)
