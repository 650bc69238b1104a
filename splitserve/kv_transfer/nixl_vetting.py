"""Which NIXL agents a receiver takes notifications from: those a live member vouches for.

A NIXL notification names its sender's agent, and nothing else says who sent it. A member's
sender publishes its agent name (128 random bits, concealed at rest with the cluster secret) in
its sealed registry record before its first push; the receiver keeps the set of names members
vouch for and reads it again when a name it does not know shows up:

    notification from A ──▶ A vouched? ── yes ──▶ handled now
                                 └─ no ──▶ held ──▶ next registry read (at most one per
                                                    `min_interval_s`) vouches for A?
                                                       ├─ yes ─▶ handled, in arrival order
                                                       └─ no ──▶ dropped: counted, logged
                                                                 once per name, no request
                                                                 touched

NOTE: a notification is dropped only after a registry read that began after it arrived, so a
sender that registered just before its first push is never turned away (even when a stranger's
notifications caused a read a moment earlier). Reads are rate-limited, so a stranger's flood
costs Redis at most one read per `min_interval_s`. At most `max_held` notifications are held:
past that, one from an unknown sender is dropped at once.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.5  # between registry reads
MAX_HELD = 4096  # notifications from unknown senders awaiting the next read
_MAX_WARNED = 4096  # agent names remembered for the once-per-name warning
_MAX_NAME_CHARS = 100  # of a stranger's agent name in the log


def label(agent: str) -> str:
    """An agent's name as logged: a member's sender is known by its name (the worker id and
    128 random bits), so only the part before the random bits is shown."""
    head, _, tail = agent[:_MAX_NAME_CHARS].rpartition("-")
    return repr(f"{head}-…" if head and tail else agent[:_MAX_NAME_CHARS])


class VouchedSenders:
    """Vets notifications by their sender's agent name against `vouched()` (what live members
    published; it may raise). Used by the receiver's one polling thread only. `num_unvouched`
    counts the notifications dropped."""

    def __init__(
        self,
        vouched: Callable[[], Collection[bytes]],
        min_interval_s: float = MIN_INTERVAL_S,
        max_held: int = MAX_HELD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._vouched = vouched
        self._min_interval_s = min_interval_s
        self._max_held = max_held
        self._clock = clock
        self._names: frozenset[str] = frozenset()
        self._held: list[tuple[str, bytes]] = []
        self._next_read = -float("inf")
        self._warned: OrderedDict[str, None] = OrderedDict()
        self._failing = False
        self.num_unvouched = 0
        self.num_reads = 0

    def check(self, sender: str, message: bytes) -> bool:
        """True if `sender` is vouched for (handle the notification now); else it is held for
        `release` (or dropped at once when too many are held)."""
        if sender in self._names:
            return True
        if len(self._held) >= self._max_held:
            self._drop(sender)
        else:
            self._held.append((sender, message))
        return False

    def release(self) -> list[tuple[str, bytes]]:
        """The held notifications whose senders a fresh read vouches for, in arrival order; the
        others are dropped. Nothing (all stay held) until a read is due and succeeds."""
        if not self._held or self._clock() < self._next_read:
            return []
        self._next_read = self._clock() + self._min_interval_s
        self.num_reads += 1
        try:
            names = frozenset(v.decode("utf-8", "replace") for v in self._vouched())
        except Exception as e:  # noqa: BLE001 - e.g. Redis unreachable: held until it answers
            if not self._failing:
                log.warning("NIXL receiver: cannot read the senders members vouch for: %r", e)
            self._failing = True
            return []
        self._failing = False
        self._names = names
        held, self._held = self._held, []
        released = []
        for sender, message in held:
            if sender in names:
                released.append((sender, message))
            else:
                self._drop(sender)
        return released

    def _drop(self, sender: str) -> None:
        self.num_unvouched += 1
        if sender in self._warned:
            return
        self._warned[sender] = None
        while len(self._warned) > _MAX_WARNED:
            self._warned.popitem(last=False)
        log.warning(
            "NIXL receiver: dropped a notification from agent %s, which no member vouches for",
            label(sender),
        )
