"""How a NIXL receiver vets notifications by sender (kv_transfer/nixl_vetting.py), on a clock the
test moves: what members vouch for is a plain set here (tests/security reads it from Redis)."""

from __future__ import annotations

import logging

import pytest

from splitserve.kv_transfer.nixl_vetting import VouchedSenders, label


class Members:
    """What live members vouch for, as the registry would answer, and how often it was asked."""

    def __init__(self) -> None:
        self.names: set[bytes] = set()
        self.down = False
        self.num_reads = 0

    def __call__(self) -> set[bytes]:
        self.num_reads += 1
        if self.down:
            raise ConnectionError("Redis unreachable")
        return set(self.names)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def members() -> Members:
    return Members()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_sender_vouched_for_after_an_earlier_read_is_taken_at_the_next(members, clock):
    vetting = VouchedSenders(members, min_interval_s=0.5, clock=clock)
    assert not vetting.check("stranger", b"s1")
    assert vetting.release() == []  # the read finds nobody: dropped
    assert (vetting.num_unvouched, members.num_reads) == (1, 1)

    members.names.add(b"p0-abc")  # registered just after that read
    clock.now += 0.1
    assert not vetting.check("p0-abc", b"m1")
    assert not vetting.check("stranger", b"s2")
    assert not vetting.check("p0-abc", b"m2")
    assert vetting.release() == []  # too soon for another read: held, not dropped
    clock.now += 0.4
    assert vetting.release() == [("p0-abc", b"m1"), ("p0-abc", b"m2")]  # in arrival order
    assert (vetting.num_unvouched, members.num_reads) == (2, 2)
    assert vetting.check("p0-abc", b"m3")  # known now: no read at all
    assert members.num_reads == 2


def test_while_the_registry_is_unreachable_notifications_are_held(members, clock, caplog):
    vetting = VouchedSenders(members, min_interval_s=0.5, clock=clock)
    members.down = True
    members.names.add(b"p0-abc")
    vetting.check("p0-abc", b"m1")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert vetting.release() == []
            clock.now += 0.5
    assert caplog.text.count("cannot read the senders") == 1
    members.down = False
    assert vetting.release() == [("p0-abc", b"m1")]
    assert vetting.num_unvouched == 0


def test_past_the_bound_an_unknown_senders_notification_is_dropped_at_once(members, clock, caplog):
    vetting = VouchedSenders(members, min_interval_s=0.5, max_held=2, clock=clock)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            vetting.check("stranger-0123456789abcdef0123456789abcdef", f"s{i}".encode())
    assert vetting.num_unvouched == 3 and members.num_reads == 0
    assert caplog.text.count("no member vouches for") == 1  # once per name
    assert "0123456789abcdef" not in caplog.text  # a name's random part is never logged


def test_a_logged_agent_name_keeps_its_worker_id_only():
    assert label("prefill-0-" + "ab" * 16) == "'prefill-0-…'"
    assert label("odd\nname") == "'odd\\nname'"
