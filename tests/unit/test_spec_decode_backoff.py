"""Acceptance backoff: a sequence whose drafts keep being rejected sits out speculation for
doubling pauses (up to 64 steps) and comes back once a probe is accepted."""

from __future__ import annotations

import pytest

from splitserve.engine.spec_decode.backoff import MAX_WAIT, AcceptanceBackoff
from splitserve.engine.spec_decode.config import SpeculativeConfig


def _run(backoff: AcceptanceBackoff, accepted_if_due, steps: int) -> list[int]:
    """The steps at which sequence "s" speculated."""
    spoke = []
    for step in range(steps):
        backoff.tick(["s"])
        if backoff.due("s"):
            spoke.append(step)
            backoff.record("s", accepted_if_due(step))
    return spoke


def test_rejected_drafts_pause_a_sequence_for_doubling_waits():
    spoke = _run(AcceptanceBackoff(0.5), lambda step: 0, 200)
    gaps = [b - a for a, b in zip(spoke, spoke[1:], strict=False)]
    assert spoke[:2] == [0, 1]  # one bad step alone pauses nothing
    assert gaps[1:6] == [3, 5, 9, 17, 33]  # pauses of 2, 4, 8, 16, 32 steps
    assert max(gaps) == MAX_WAIT + 1
    assert len(spoke) < 12  # out of 200 steps


def test_an_accepted_probe_resumes_speculation_every_step():
    spoke = _run(AcceptanceBackoff(0.5), lambda step: 0 if step < 20 else 3, 60)
    assert all(step in spoke for step in range(40, 60))


def test_good_acceptance_never_pauses_and_finished_sequences_are_forgotten():
    backoff = AcceptanceBackoff(0.5)
    assert _run(backoff, lambda step: 1, 30) == list(range(30))
    backoff.tick([])
    assert backoff._states == {}


def test_min_accepted_is_validated():
    with pytest.raises(ValueError, match="min_accepted"):
        SpeculativeConfig("ngram", 2, min_accepted=3)
    assert SpeculativeConfig("ngram", 2, min_accepted=0).min_accepted == 0


def test_a_paused_sequence_probes_until_a_probe_is_accepted():
    backoff = AcceptanceBackoff(0.5)
    spoke = {}  # step -> whether it was a probe (one draft token)
    for step in range(60):
        backoff.tick(["s"])
        if backoff.due("s"):
            spoke[step] = backoff.probing("s")
            backoff.record("s", 0 if step < 30 else 1)
    assert [step for step, probe in spoke.items() if probe] == [4, 9, 18, 35]
    assert not spoke[0] and not spoke[1]  # full drafts until the first pause
    assert all(not spoke[step] for step in range(36, 60))  # the probe at 35 was taken
    assert not AcceptanceBackoff(0.5).probing("never seen")
