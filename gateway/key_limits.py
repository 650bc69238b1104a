"""Limits per caller: how many requests one API key may have in flight at the gateway
(`--max-inflight-per-key`), so that one client cannot take every slot of `--max-inflight` from
the others. Used on the server's event loop only (no locks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from splitserve.engine.errors import Overloaded


class PerKeyInflight:
    """At most `limit` requests in flight per principal (0: no limit)."""

    def __init__(self, limit: int = 0) -> None:
        if limit < 0:
            raise ValueError(f"--max-inflight-per-key must not be negative, got {limit}")
        self.limit = limit
        self._counts: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(self._counts.values())

    @contextmanager
    def hold(self, principal: str) -> Iterator[None]:
        """One slot of `principal` for the duration; Overloaded (RESOURCE_EXHAUSTED) if it has
        none left."""
        if not self.limit:
            yield
            return
        held = self._counts.get(principal, 0)
        if held >= self.limit:
            raise Overloaded(
                f"this API key has {held} requests in flight, its limit "
                "(--max-inflight-per-key); retry when one has finished"
            )
        self._counts[principal] = held + 1
        try:
            yield
        finally:
            left = self._counts[principal] - 1
            if left:
                self._counts[principal] = left
            else:
                del self._counts[principal]
