"""The garbage collector in a serving process: the start-up heap frozen, long pauses logged.

A worker or gateway process holds hundreds of thousands of objects once it has imported torch,
transformers and gRPC and loaded its model and tokenizer (about 480k in an engine process), and
none of them will ever be garbage. CPython's oldest-generation collection walks all of them: about
0.4 s on a small VM, tens to hundreds of milliseconds on a server, during which the process does
nothing else — no engine step, no streamed token. Freezing the start-up heap (`gc.freeze()`,
as vLLM's and SGLang's serving processes do) moves those objects out of the collector's sight,
so a collection walks only what serving allocated since. `SPLITSERVE_GC_FREEZE=0` leaves the heap
as it is (to measure the difference).

`GCPauses` times every collection through `gc.callbacks`: a pause over `LONG_PAUSE_S` is logged
(at most once a minute) and `summary()` gives the counts, worst and total pause per generation,
logged when the process stops.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

FREEZE_ENV = "SPLITSERVE_GC_FREEZE"
LONG_PAUSE_S = 0.05
_WARN_EVERY_S = 60.0


def freeze_startup_heap(what: str) -> int:
    """Freeze every object the process holds now (its start-up state); how many were frozen
    (0 when `SPLITSERVE_GC_FREEZE=0`). No collection first: one would walk the whole heap
    while holding the interpreter lock, and by now the process's heartbeat and engine loop run
    on other threads (a 0.4 s pause on a small VM, a lapsed lease on a loaded one); the
    start-up garbage it would have freed is frozen with the rest, a few megabytes at most."""
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return 0
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection", what, frozen)
    return frozen


class GCPauses:
    """Every collection's pause in this process, by generation (install once per process)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._started = 0.0
        self._warned = -_WARN_EVERY_S

    def install(self) -> GCPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        gen = min(int(info.get("generation", 2)), 2)
        pause = now - self._started
        self.count[gen] += 1
        self.total_s[gen] += pause
        self.max_s[gen] = max(self.max_s[gen], pause)
        if pause >= LONG_PAUSE_S and now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning(
                "%s: a generation-%d garbage collection paused this process %.0f ms",
                self.what,
                gen,
                pause * 1e3,
            )

    def summary(self) -> dict[str, Any]:
        return {
            f"gen{g}": {
                "collections": self.count[g],
                "max_ms": round(self.max_s[g] * 1e3, 2),
                "total_ms": round(self.total_s[g] * 1e3, 1),
            }
            for g in range(3)
        }

    def log_summary(self) -> None:
        parts = [
            f"gen{g} {self.count[g]} (max {self.max_s[g] * 1e3:.1f} ms, "
            f"total {self.total_s[g] * 1e3:.0f} ms)"
            for g in range(3)
        ]
        log.info("%s: garbage collections: %s", self.what, "; ".join(parts))


_pauses: GCPauses | None = None


def settle(what: str) -> GCPauses:
    """At the end of a serving process's start-up: freeze the heap, start timing pauses. A
    process that starts several services (a test, a worker with its engine core as a thread)
    keeps the first one's watch: one set of callbacks a process."""
    global _pauses
    freeze_startup_heap(what)
    if _pauses is None:
        _pauses = GCPauses(what).install()
    return _pauses
