"""The prefix index's change log: a Redis stream beside its sets, so a gateway can hold the index
in memory (Dynamo's and llm-d's form) and route without a Redis round trip.

Every `add_prefix_blocks`, `remove_prefix_blocks` and `clear_prefix_blocks` appends its change
to `{ns}:index_events` in the same MULTI as the sets' update: the log and the sets never
disagree. An entry is `op` ("a" add, "r" remove, "c" clear a worker and its host tier, "n" a
mark), `id` (the index id) and `h` (the blocks' raw hashes end to end, each `w` bytes).

A reader takes the log's last id, then the sets (`snapshot`), then every entry after that id
(`read`): each entry sets or unsets (id, block) pairs, so replaying ones the snapshot already
saw changes nothing. The log is trimmed to about `EVENTS_MAXLEN` entries; a reader that fell
further behind (its last id is gone: trimmed, or Redis lost its data) must read the sets again.

NOTE: its memory is bounded by its length, not by the index: at most about `EVENTS_MAXLEN`
entries of `EVENT_MAX_HASHES` hashes (about 8 MiB of 16-byte hashes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

EVENTS_MAXLEN = 2048
EVENT_MAX_HASHES = 256  # a publish of more blocks is split into entries of at most this many

ADD, REMOVE, CLEAR, MARK = "a", "r", "c", "n"


def events_key(ns: str) -> str:
    return f"{ns}:index_events"


def worker_key(ns: str, index_id: str) -> str:
    """The set of hex hashes `index_id` holds (registry.py's key layout)."""
    return f"{ns}:prefix_worker:{index_id}"


def append(pipe: Any, ns: str, op: str, index_id: str, hashes: Sequence[bytes] = ()) -> None:
    """Queue the entries of one change on `pipe` (the caller's MULTI, beside the sets' update)."""
    key = events_key(ns)
    if not hashes:
        pipe.xadd(key, {"op": op, "id": index_id}, maxlen=EVENTS_MAXLEN, approximate=True)
        return
    width = len(hashes[0])
    if any(len(h) != width for h in hashes):
        for h in hashes:  # NOTE: not the engine's (16-byte hashes): one entry each
            append(pipe, ns, op, index_id, [h])
        return
    for i in range(0, len(hashes), EVENT_MAX_HASHES):
        chunk = b"".join(hashes[i : i + EVENT_MAX_HASHES])
        fields = {"op": op, "id": index_id, "w": width, "h": chunk}
        pipe.xadd(key, fields, maxlen=EVENTS_MAXLEN, approximate=True)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Event:
    op: str
    index_id: str
    hashes: list[bytes]


def _event(fields: dict[bytes, bytes]) -> Event:
    raw = fields.get(b"h", b"")
    width = int(fields.get(b"w", b"0") or 0)
    hashes = [raw[i : i + width] for i in range(0, len(raw), width)] if width else []
    return Event(fields[b"op"].decode(), fields[b"id"].decode(), hashes)


class PrefixEventLog:
    """Reads the log and the sets, over a client of its own (a blocking read holds its
    connection). Its client must not decode responses: the hashes are raw bytes."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._client = client
        self._ns = namespace
        self._key = events_key(namespace)

    def close(self) -> None:
        self._client.close()

    def head(self) -> str:
        """The id of the log's last entry; marks an empty (or lost) log first, so that a reader
        can always tell, by its last id still being there, that nothing after it was trimmed."""
        last: Any = self._client.xrevrange(self._key, count=1)
        if last:
            return _text(last[0][0])
        mark: Any = self._client.xadd(self._key, {"op": MARK, "id": ""}, maxlen=EVENTS_MAXLEN)
        return _text(mark)

    def snapshot(self) -> dict[str, list[bytes]]:
        """Every index id's blocks, as the sets hold them now (raw hashes)."""
        head = worker_key(self._ns, "")
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*"
        keys = list(self._client.scan_iter(match=pattern, count=1000))
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.smembers(key)
        out: dict[str, list[bytes]] = {}
        for key, members in zip(keys, pipe.execute(), strict=True):
            out[_text(key)[len(head) :]] = [bytes.fromhex(_text(m)) for m in members]
        return out

    def read(
        self, after: str, block_ms: int | None, count: int = 512
    ) -> tuple[list[Event], str] | None:
        """The entries after id `after` (waiting up to `block_ms` for one; None: not at all)
        and the new last id; None if `after` is gone from the log (trimmed, or Redis lost its
        data): entries may have been missed, and the reader must start again from `head` and
        `snapshot`."""
        if block_ms is not None and block_ms <= 0:
            raise ValueError("block_ms must be > 0 (0 would wait forever) or None")
        reply: Any = self._client.xread({self._key: after}, count=count, block=block_ms)
        # NOTE: checked after the read: `after` still there means nothing after it had been
        # trimmed when the read ran (the log is trimmed from its oldest end only).
        if not self._client.xrange(self._key, min=after, max=after, count=1):
            return None
        events: list[Event] = []
        last = after
        for _, entries in reply or ():
            for entry_id, fields in entries:
                events.append(_event(fields))
                last = _text(entry_id)
        return events, last


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
