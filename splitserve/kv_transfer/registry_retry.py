"""Riding through a Redis that blinks: every registry call is safe to repeat (see registry.py),
so a call that meets a lost connection retries with backoff, then raises `RegistryUnavailable`
(UNAVAILABLE to a client: never INTERNAL).

Two budgets: calls on a request's path (reserve, begin_write, handoff, discovery, routing) retry
for `retry_s` seconds, so a short outage only delays them; the periodic ones (heartbeats, lease
renewals, releases, prefix-index updates) retry briefly (a dropped pooled connection) and leave
the rest to their next turn or to the lease. An outage is logged once when it starts (at most
once per `WARN_EVERY_S`) and once when Redis answers again: never a traceback per call.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import redis

from splitserve.kv_transfer.registry_records import RecordLost, RegistryUnavailable

log = logging.getLogger("splitserve.kv_transfer.registry")
C = TypeVar("C", bound=type)

# NOTE: BusyLoadingError (a restarted Redis loading its data) is a ConnectionError.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
BRIEF_RETRY_S = 0.2
WARN_EVERY_S = 30.0
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 0.5


class Outage:
    """Whether Redis is unreachable right now, as seen by one registry client; logs the changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._warned = -math.inf

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            if self._since is None:
                self._since = now
            warn = now - self._warned >= WARN_EVERY_S
            if warn:
                self._warned = now
        if warn:
            log.warning("Redis unreachable (%s); registry calls retry meanwhile", brief(exc))

    def answered(self) -> None:
        if self._since is None:  # NOTE: the common case, without the lock
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning("Redis answers again (after %.1f s)", time.monotonic() - since)


def brief(exc: BaseException) -> str:
    """The first line of an error's text, bounded (no tracebacks, no multi-line dumps)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


def call(fn: Callable[[], Any], retry_s: float, outage: Outage) -> Any:
    """`fn()`, repeated with jittered exponential backoff while Redis is unreachable (or the
    record was lost and not yet re-published), for up to `retry_s` seconds."""
    deadline = time.monotonic() + retry_s
    backoff = FIRST_BACKOFF_S
    while True:
        try:
            result = fn()
        except redis.AuthenticationError as exc:  # NOTE: a ConnectionError that no retry mends
            raise RegistryUnavailable(f"Redis refused the credentials: {brief(exc)}") from None
        except REDIS_DOWN as exc:
            outage.failed(exc)
            error: RegistryUnavailable = RegistryUnavailable(
                f"the registry (Redis) is unavailable: {brief(exc)}"
            )
        except RecordLost as exc:
            error = exc  # NOTE: its worker re-publishes it on its next housekeeping turn
        else:
            outage.answered()
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise error from None
        time.sleep(min(remaining, backoff * random.uniform(0.5, 1.5)))
        backoff = min(MAX_BACKOFF_S, backoff * 2)


def retrying(patient: Collection[str], own: Collection[str] = ()) -> Callable[[C], C]:
    """A class decorator for `Registry`: each public method goes through `call`, those named in
    `patient` with the registry's `retry_s`, the others with `BRIEF_RETRY_S`; those named in
    `own` call `call` themselves (e.g. to keep one nonce across their attempts).

    The class's instances carry `_retry_s` and `_outage`."""

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            retry_s = self._retry_s if name in patient else min(self._retry_s, BRIEF_RETRY_S)
            return call(lambda: method(self, *args, **kwargs), retry_s, self._outage)

        return wrapper

    def decorate(cls: C) -> C:
        names = [n for n in dir(cls) if n[0] != "_" and n not in (*own, "close")]
        methods = {n: m for n in names if inspect.isfunction(m := getattr(cls, n))}
        unknown = set(patient) - set(methods) - set(own)
        if unknown:
            raise TypeError(f"no such methods: {sorted(unknown)}")
        for name, method in methods.items():  # NOTE: those of its bases too (PrefixIndex)
            setattr(cls, name, wrap(name, method))
        return cls

    return decorate
