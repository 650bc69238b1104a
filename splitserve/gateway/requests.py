"""Which requests run in this gateway, by id: the one place that owns request identity.

Ids are scoped per API key: a request is known by (its key's principal, its id), so two keys
may run the same id side by side, and one key never learns, blocks or aborts another's. Without
API keys every caller is the anonymous principal: one namespace, as before keys existed.

A Generate call claims its id before it does any work, and gives the claim back when its stream
ends. A second call with an id that is running is refused (ALREADY_EXISTS) before it holds
anything, so its end touches nothing of the first: every clean-up acts on what its own claim
and its own route hold, never on whatever an id names.

`Abort(request_id)` finds the claim and stops its request wherever it is (validated, queued for
a prefill worker, reserving, prefilling, decoding); the stream then ends with a final message
whose samples finish with FINISH_REASON_ABORT. An Abort for an id that is not running (yet) is
remembered for a while, so a Generate that arrives just after it ends at once, the same way.

    Generate ─claim(id)─▶ Claim ─▶ orchestrator ─▶ stream ─▶ release(claim)
    Abort(id) ─────────▶ Claim.abort(): cancel the wait on the workers (or, between messages,
                          stop before the next one)

NOTE: used on the server's event loop only (no locks): claims, aborts and releases never
interleave with each other.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from splitserve.engine.errors import AlreadyExists, quoted


@dataclass(eq=False)
class Claim:
    """One Generate call's hold on its request id."""

    request_id: str
    task: asyncio.Task | None = field(default=None, repr=False)  # the call's handler
    aborted: bool = False  # Abort asked for it: the stream ends with FINISH_REASON_ABORT
    waiting: bool = False  # its task awaits the workers (where a cancel lands in the request)
    finished: bool = False  # its final message is out: nothing is left to abort
    _cancelled: bool = False  # `abort` cancelled the task (once)
    owner: str = ""  # the principal (API key) that made it: only it can abort it
    generated: int = 0  # tokens streamed so far (all its samples)

    def abort(self) -> bool:
        """Stop the request; False if its final message was already sent."""
        if self.finished:
            return False
        self.aborted = True
        if self.waiting and self.task is not None and not self._cancelled:
            # NOTE: the task is suspended inside its wait on the workers (the flag is set and
            # cleared with no await in between), so the cancel lands there: the orchestrator
            # frees what the request holds, and the handler turns it into the final message.
            self._cancelled = True
            self.task.cancel()
        return True

    def absorb_cancel(self) -> bool:
        """After a CancelledError in the task: True if it was only this claim's abort (the
        task may go on to send the final message), False if the call itself is cancelled."""
        if not self._cancelled or self.task is None:
            return False
        self._cancelled = False
        return self.task.uncancel() == 0


class RequestTable:
    """The running request ids, and the recently aborted ids not seen yet."""

    def __init__(self, remember: int = 4096, remember_s: float = 30.0) -> None:
        self._claims: dict[str, Claim] = {}  # by `_scoped(owner, request id)`
        # Ids aborted before their Generate arrived, and ids that just ended (an Abort that
        # comes late for those is not an early one), each with when it was noted.
        self._early_aborts: OrderedDict[str, float] = OrderedDict()
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._remember = remember
        self._remember_s = remember_s

    def __len__(self) -> int:
        return len(self._claims)

    def holds(self, request_id: str, owner: str = "") -> bool:
        """Whether `owner`'s request `request_id` runs here."""
        return _scoped(owner, request_id) in self._claims

    def ids(self) -> list[tuple[str, str]]:
        """The running requests, as (owner, request id)."""
        return [(claim.owner, claim.request_id) for claim in self._claims.values()]

    def claim(self, request_id: str, owner: str = "") -> Claim:
        """Hold `request_id` for the calling task, on behalf of `owner`; AlreadyExists if
        `owner` runs it already (another owner's request with that id is none of its business)."""
        scoped = _scoped(owner, request_id)
        if scoped in self._claims:
            raise AlreadyExists(f"request id {quoted(request_id)} is already running")
        claim = Claim(request_id, asyncio.current_task(), owner=owner)
        self._forget_old()
        if self._early_aborts.pop(scoped, None) is not None:
            claim.aborted = True
        self._ended.pop(scoped, None)
        self._claims[scoped] = claim
        return claim

    def release(self, claim: Claim) -> None:
        """Give the id back; only the claim that holds it can."""
        scoped = _scoped(claim.owner, claim.request_id)
        if self._claims.get(scoped) is claim:
            del self._claims[scoped]
            self._note(self._ended, scoped)

    def abort(self, request_id: str, owner: str = "") -> bool:
        """Abort `owner`'s running request with this id (True), or remember the id for a while
        in case its Generate is still on the way (False: nothing was running). Another owner's
        request is not touched: to a stranger, it answers as if the id were unknown."""
        scoped = _scoped(owner, request_id)
        claim = self._claims.get(scoped)
        if claim is not None:
            return claim.abort()
        self._forget_old()
        if scoped not in self._ended:
            self._note(self._early_aborts, scoped)
        return False

    def _note(self, memory: OrderedDict[str, float], scoped: str) -> None:
        memory[scoped] = time.monotonic()
        memory.move_to_end(scoped)
        while len(memory) > self._remember:
            memory.popitem(last=False)

    def _forget_old(self) -> None:
        oldest = time.monotonic() - self._remember_s
        for memory in (self._early_aborts, self._ended):
            while memory and next(iter(memory.values())) < oldest:
                memory.popitem(last=False)


def _scoped(owner: str, request_id: str) -> str:
    """A request's key here: its id within its owner's namespace."""
    return f"{owner}\x00{request_id}"
