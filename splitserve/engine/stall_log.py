"""The stall log's threshold, shared by the engine loop and the services' event loops (no
torch: the gateway reads it too)."""

from __future__ import annotations

import os

STALL_LOG_ENV = "SPLITSERVE_STALL_LOG_MS"


def stall_log_s() -> float:
    """`SPLITSERVE_STALL_LOG_MS`: log every engine turn and event-loop wake-up that takes longer
    than this, with its parts and CLOCK_MONOTONIC time (0 or unset: off). For finding what
    stalls streams; the times line up with a load client's token times on the same host."""
    raw = os.environ.get(STALL_LOG_ENV, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{STALL_LOG_ENV} must be a number of milliseconds, got {raw!r}") from None
    return max(0.0, value) / 1e3
