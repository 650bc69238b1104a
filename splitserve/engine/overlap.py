"""Overlapped decode steps: the host prepares and launches step N+1 while the GPU runs step N.

A decode step in which every row is plain greedy (no logprobs, bans, penalties, grammar or
pending fork) needs nothing from the host between the model and the next step's input: its
tokens are the logits' argmax, already on the device. Such a step is launched and left in
flight; the next `LLMEngine.step` schedules as if its tokens were known, launches the next step
with those tokens copied on the device, and only then waits for them and applies them:

    step() k:    schedule N+1 ─ launch N+1 (inputs ← N's tokens, on device) ─ wait N ─ settle N
    GPU:         ....... N .......|....... N+1 .......

While a step is in flight each of its sequences counts its token as computed and holds a
`PLACEHOLDER` as its newest token; settling puts the real token there, caches a block that
became full, and applies token stops. A sequence that stops when its step settles has already
been launched into the next one; that row is wasted and its token dropped. Its blocks are freed
at once, which is safe for anything ordered after it on the GPU's stream; a reservation (which
remote writers fill outside that order) first waits for the step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.engine.sequence import Sequence

PLACEHOLDER = -1
"""A sequence's newest token while the step that samples it is in flight."""


@dataclass
class InFlight:
    """A launched decode step whose tokens are still on the device."""

    rows: dict[Sequence, int]  # each launched sequence's row in `tokens`
    tokens: torch.Tensor  # [rows] int64, on the model's device
    host: torch.Tensor  # [rows] int64 on the host, filled once `done` is reached
    done: torch.cuda.Event | None  # None on the CPU: `host` is ready at launch
    # The sequences that hold a placeholder for this step, with their computed tokens after it.
    advanced: list[tuple[Sequence, int]] = field(default_factory=list)

    def wait(self) -> None:
        """Block until the step has run (its tokens are on the host)."""
        if self.done is not None:
            self.done.synchronize()

    def token_ids(self) -> dict[Sequence, int]:
        self.wait()
        values = self.host.tolist()
        return {seq: values[row] for seq, row in self.rows.items()}
