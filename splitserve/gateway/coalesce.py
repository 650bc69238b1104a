"""Coalescing a request's new tokens into fewer client messages (`stream_interval`).

Relaying costs the gateway per message, not per token: a gRPC write, an SSE event, a metrics
observation. A decode worker may send a message per step (one token); `Coalescer` holds a
sample's tokens until it has `interval` of them and then hands them on as one `SampleDelta`:

    worker:  [t1] [t2] [t3] [t4] [t5] ... end        interval 4
    client:            [t1 t2 t3 t4]  ... [t5 …] (flushed before the final message)

Interval 1 passes every chunk through as it is (not copied). A chunk that already holds
`interval` tokens or more (a worker that batches its own messages) also goes through as it is
when nothing of its sample is held. Tokens are never held past the end of the stream: `flush`
hands on what is left, before the final message.

`merge_deltas` is the other half, which needs no interval: the chunks that queued up while a
stream's previous client write was in progress (`relay.py`) become one chunk per sample. The
same merge serves `stream_interval_ms`, a gap in time between a stream's messages (`relay.py`
holds what comes sooner); the two settings combine (the time gate first, then the count).
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.errors import InvalidRequest
from splitserve.protos.convert import join_delta
from splitserve.protos.v1 import common_pb2

# The most tokens per message a request may ask for: past this, every stream is one message.
MAX_STREAM_INTERVAL = 4096
# The longest gap between two messages a request may ask for (ms).
MAX_STREAM_INTERVAL_MS = 10_000


def check_stream_interval(interval: int, what: str = "stream_interval") -> int:
    """`interval` if it is 1..MAX_STREAM_INTERVAL; else InvalidRequest naming `what`."""
    if not 1 <= interval <= MAX_STREAM_INTERVAL:
        raise InvalidRequest(
            f"{what} must be 1 to {MAX_STREAM_INTERVAL} tokens per message, got {interval}"
        )
    return interval


def check_stream_interval_ms(interval_ms: int, what: str = "stream_interval_ms") -> int:
    """`interval_ms` if it is 0..MAX_STREAM_INTERVAL_MS; else InvalidRequest naming `what`."""
    if not 0 <= interval_ms <= MAX_STREAM_INTERVAL_MS:
        raise InvalidRequest(
            f"{what} must be 0 to {MAX_STREAM_INTERVAL_MS} ms between messages, got {interval_ms}"
        )
    return interval_ms


def merge_deltas(chunks: Sequence[common_pb2.SampleDelta]) -> list[common_pb2.SampleDelta]:
    """One delta per sample for `chunks` (received in this order): each sample's token ids,
    text and logprobs joined in order, the samples in the order they first appear. A sample
    with one chunk keeps that chunk (not copied); the inputs are never changed."""
    if len(chunks) == 1:
        return list(chunks)
    merged: dict[int, list[common_pb2.SampleDelta]] = {}
    for chunk in chunks:
        merged.setdefault(chunk.index, []).append(chunk)
    return [parts[0] if len(parts) == 1 else _joined(parts) for parts in merged.values()]


def _joined(parts: list[common_pb2.SampleDelta]) -> common_pb2.SampleDelta:
    joined = common_pb2.SampleDelta(index=parts[0].index)
    for part in parts:
        join_delta(joined, part)
    return joined


class Coalescer:
    """Per-sample buffers of new tokens for one request (see the module doc)."""

    __slots__ = ("interval", "_held")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[int, common_pb2.SampleDelta] = {}

    def add(self, chunk: common_pb2.SampleDelta) -> common_pb2.SampleDelta | None:
        """The delta to send now for `chunk` (it, or the sample's held tokens with it), or
        None while its sample has fewer than `interval` tokens held."""
        if self.interval <= 1:
            return chunk
        held = self._held.get(chunk.index)
        if held is None:
            if len(chunk.token_ids) >= self.interval:
                return chunk
            held = self._held[chunk.index] = common_pb2.SampleDelta(index=chunk.index)
        join_delta(held, chunk)
        if len(held.token_ids) < self.interval:
            return None
        del self._held[chunk.index]
        return held

    def flush(self) -> list[common_pb2.SampleDelta]:
        """Every sample's held tokens (in sample order), now; nothing is held after."""
        held = [self._held[i] for i in sorted(self._held)]
        self._held.clear()
        return held
