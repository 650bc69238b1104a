"""Acceptance backoff: a sequence whose drafts keep being rejected sits out speculation.

A speculative step costs more than a plain one (the proposal, K more verified positions, and no
overlapped scheduling), so it pays only while drafts are accepted. Per sequence, a running mean
of accepted drafts per verification (each new one weighs half) below `min_accepted` makes the
sequence sit out `wait` steps, then probe once; each failed probe doubles `wait` (2, 4, ...,
64), and a verification that brings the mean back up resets it:

    accepted  3 3 0 0 | pause 2 | 0 | pause 4 | 0 | pause 8 | 2 ...

Outputs never change (verification decides them); only how often drafts are asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

FIRST_WAIT = 2
MAX_WAIT = 64


@dataclass
class _State:
    mean: float  # running mean of accepted drafts per verification
    wait: int = FIRST_WAIT  # the next pause, in steps
    resume_at: int = 0  # the first step this sequence may speculate again
    probing: bool = False  # paused before and not yet back above the bar


class AcceptanceBackoff:
    """Which sequences are due to speculate, from how their drafts fared."""

    def __init__(self, min_accepted: float) -> None:
        self.min_accepted = min_accepted
        self._states: dict[str, _State] = {}
        self._step = 0

    def tick(self, running_ids: Iterable[str]) -> None:
        """A new engine step; forget sequences no longer running."""
        self._step += 1
        running = set(running_ids)
        if len(self._states) > len(running):
            self._states = {k: v for k, v in self._states.items() if k in running}

    def due(self, seq_id: str) -> bool:
        state = self._states.get(seq_id)
        return state is None or state.resume_at <= self._step

    def probing(self, seq_id: str) -> bool:
        """Whether `seq_id` is due only to probe (its drafts failed before): one draft token
        tells as well as K whether they came right again, at a fraction of the step."""
        state = self._states.get(seq_id)
        return state is not None and state.probing

    def record(self, seq_id: str, accepted: int) -> None:
        """A verification of `seq_id` accepted `accepted` drafts."""
        state = self._states.get(seq_id)
        if state is None:
            # NOTE: starts at twice the bar, so one bad first step alone pauses nothing.
            state = self._states[seq_id] = _State(mean=2.0 * self.min_accepted)
        state.mean = 0.5 * (state.mean + accepted)
        if state.mean >= self.min_accepted:
            state.wait = FIRST_WAIT
            state.probing = False
            return
        state.probing = True
        state.resume_at = self._step + 1 + state.wait
        state.wait = min(2 * state.wait, MAX_WAIT)
        state.mean = self.min_accepted  # the probe alone decides: below the bar pauses again
