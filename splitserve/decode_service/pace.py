"""Which of a Decode stream's outputs go out (`--stream-interval` tokens apart), on the
stream's task or, for a DecodeMany stream, where the engine core's outputs are delivered.

A DecodeMany stream's tokens need no task of their own: the front hands each engine step's
outputs to the streams' queues in one callback on the event loop, and a stream whose handler
waits on an empty queue takes a plain output right there (`StreamQueue.direct`): its deltas
join the call's next message at once, without waking the stream's task and the three
generators above it (the worker's, the servicer's, DecodeMany's) for every token. The final
output, an error, or an output behind one still queued goes the task's way, so what a stream
sends keeps its order, and its end (finish, abort, a move) is handled in one place.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.engine.outputs import RequestOutput


class Pace:
    """The tokens a stream has sent; an output is due once `interval` more have come."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.sent = 0

    def due(self, out: RequestOutput) -> bool:
        """Whether `out` goes out (its tokens counted as sent if so). Outputs are cumulative:
        one that is not due is carried by the next one that is."""
        num_tokens = sum(len(s.token_ids) for s in out.outputs)
        if out.finished or num_tokens - self.sent >= self.interval:
            self.sent = num_tokens
            return True
        return False

    def taker(self, send: Callable[[RequestOutput], None]) -> Callable[[object], bool]:
        """A `StreamQueue.direct` that sends a due plain output with `send` and drops one that
        is not due; it declines the final output and errors (the stream's task takes those)."""

        def take(item: object) -> bool:
            if not isinstance(item, RequestOutput) or item.finished:
                return False
            if self.due(item):
                send(item)
            return True

        return take
