"""Blocks a decode worker holds for prompts whose KV is still arriving.

A reservation lives from `Reserve` until `Decode` admits the request (or it is aborted, or its
lease in Redis expires because the prefill side died). Pushes write into it under its lock;
reclaiming takes the same lock and marks it dead first, so no push lands in freed blocks.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class LocalReservation:
    request_id: str
    fence: int
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_size: int
    created: float = field(default_factory=time.monotonic)
    received: set[int] = field(default_factory=set)
    dead: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def needed(self) -> frozenset[int]:
        """Destination blocks a prefill worker must fill: all but the cached prefix."""
        return frozenset(self.block_ids[self.num_cached_tokens // self.block_size :])

    @property
    def complete(self) -> bool:
        return self.needed <= self.received

    def progress(self) -> str:
        return f"{len(self.received & self.needed)} of {len(self.needed)} blocks"


class ReservationBook:
    """Thread-safe map of request id -> LocalReservation."""

    def __init__(self) -> None:
        self._items: dict[str, LocalReservation] = {}
        self._lock = threading.Lock()

    def add(self, reservation: LocalReservation) -> None:
        with self._lock:
            self._items[reservation.request_id] = reservation

    def get(self, request_id: str) -> LocalReservation | None:
        with self._lock:
            return self._items.get(request_id)

    def pop(self, request_id: str) -> LocalReservation | None:
        """Remove and return it, marked dead so that late pushes are refused."""
        with self._lock:
            reservation = self._items.pop(request_id, None)
        if reservation is not None:
            with reservation.lock:
                reservation.dead = True
        return reservation

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
