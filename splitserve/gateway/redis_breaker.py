"""A gateway replica's view of whether its shared state in Redis can be reached.

While Redis is down, every call would wait out a connect timeout (seconds) on each request's
path. After a failure the callers skip Redis for `cool_s` and act alone (their own request table
and counts), then try again: one slow call per `cool_s`, not one per request.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Breaker:
    def __init__(self, what: str, cool_s: float = 1.0) -> None:
        self.what = what
        self.cool_s = cool_s
        self._until = 0.0
        self._down_since: float | None = None

    @property
    def is_open(self) -> bool:
        """True while Redis is to be skipped."""
        return time.monotonic() < self._until

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._until = now + self.cool_s
        if self._down_since is None:
            self._down_since = now
            log.warning(
                "%s: Redis is unreachable (%s); this gateway replica acts alone until it "
                "answers again", self.what, str(exc).splitlines()[0] if str(exc) else type(exc)
            )  # fmt: skip

    def answered(self) -> None:
        if self._down_since is not None:
            log.warning(
                "%s: Redis answers again (after %.1f s)",
                self.what,
                time.monotonic() - self._down_since,
            )
            self._down_since = None
