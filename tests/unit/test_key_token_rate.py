"""Per-key token rate at the gateway (`--max-tokens-per-minute-per-key`): a token bucket per
API key, on a clock the test moves."""

from __future__ import annotations

import pytest

from splitserve.engine.errors import Overloaded
from splitserve.gateway.key_limits import PerKeyTokenRate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_gets_a_minutes_worth_then_waits_for_the_refill():
    clock = Clock()
    rate = PerKeyTokenRate(600, clock)  # 10 tokens a second
    rate.charge("alice", 400)
    rate.charge("alice", 200)
    with pytest.raises(Overloaded, match=r"retry in 5 s"):
        rate.charge("alice", 50)
    rate.charge("bob", 600)  # another key has its own bucket
    clock.now += 5.0
    rate.charge("alice", 50)
    clock.now += 3600.0  # the bucket never holds more than a minute's worth
    rate.charge("alice", 600)
    with pytest.raises(Overloaded):
        rate.charge("alice", 1)


def test_what_a_request_did_not_use_is_given_back():
    clock = Clock()
    rate = PerKeyTokenRate(100, clock)
    rate.charge("alice", 100)  # prompt + max_tokens, up front
    rate.refund("alice", 70)  # it stopped early
    rate.charge("alice", 70)
    with pytest.raises(Overloaded):
        rate.charge("alice", 1)


def test_a_request_larger_than_a_minute_is_refused_as_such_and_charges_nothing():
    rate = PerKeyTokenRate(100, Clock())
    with pytest.raises(Overloaded, match="more than this API key's 100 per minute"):
        rate.charge("alice", 101)
    rate.charge("alice", 100)


def test_no_limit_by_default_and_a_negative_one_is_refused():
    rate = PerKeyTokenRate()
    for _ in range(100):
        rate.charge("alice", 10**9)
    with pytest.raises(ValueError, match="must not be negative"):
        PerKeyTokenRate(-1)
