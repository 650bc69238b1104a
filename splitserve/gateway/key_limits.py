"""Limits per caller: how many requests one API key may have in flight at the gateway
(`--max-inflight-per-key`), so that one client cannot take every slot of `--max-inflight` from
the others, and how many tokens it may ask for per minute (`--max-tokens-per-minute-per-key`).
Used on the server's event loop only (no locks)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
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


class PerKeyTokenRate:
    """At most `per_minute` tokens per principal per minute (0: no limit), as a token bucket
    that refills continuously and holds at most a minute's worth.

    A request is charged up front what it may cost: its prompt plus `n` times `max_tokens`;
    what it did not generate is given back when it ends (`refund`). A request that needs more
    than a whole minute's worth can never pass and is refused as such."""

    def __init__(self, per_minute: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute < 0:
            raise ValueError(
                f"--max-tokens-per-minute-per-key must not be negative, got {per_minute}"
            )
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # principal -> (tokens, as of)

    def _level(self, principal: str) -> float:
        now = self._clock()
        tokens, since = self._buckets.get(principal, (float(self.per_minute), now))
        return min(float(self.per_minute), tokens + (now - since) * self.per_minute / 60.0)

    def charge(self, principal: str, tokens: int) -> None:
        """Take `tokens` from `principal`'s bucket, or raise Overloaded (RESOURCE_EXHAUSTED /
        HTTP 429) saying when it may retry."""
        if not self.per_minute:
            return
        if tokens > self.per_minute:
            raise Overloaded(
                f"this request may use {tokens} tokens (prompt + n * max_tokens), more than this "
                f"API key's {self.per_minute} per minute (--max-tokens-per-minute-per-key); "
                "lower max_tokens or n"
            )
        level = self._level(principal)
        if level < tokens:
            wait_s = math.ceil((tokens - level) * 60.0 / self.per_minute)
            raise Overloaded(
                f"this API key is at its limit of {self.per_minute} tokens per minute "
                f"(--max-tokens-per-minute-per-key); retry in {wait_s} s"
            )
        self._buckets[principal] = (level - tokens, self._clock())

    def refund(self, principal: str, tokens: int) -> None:
        """Give back what a request was charged and did not use."""
        if not self.per_minute or tokens <= 0:
            return
        self._buckets[principal] = (self._level(principal) + tokens, self._clock())
