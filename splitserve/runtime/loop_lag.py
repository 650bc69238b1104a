"""Late wake-ups of a serving process's event loop, logged (`SPLITSERVE_STALL_LOG_MS`).

Every stream a process serves waits while its event loop is held up (a handler that blocks, a
long callback, another thread holding the interpreter lock). With the stall log on, a task on
the loop sleeps `TICK_S` at a time and logs each wake-up later than the threshold, with its
CLOCK_MONOTONIC time, so a stall seen by clients can be put next to the process that stalled
(the engine loop logs its slow turns the same way: engine/engine_loop.py). A thread beside it
catches the loop while it is held: once a tick is overdue by the threshold it logs what the
loop's thread is running and where every other thread of the process stands.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback

from splitserve.engine.stall_log import stall_log_s

log = logging.getLogger(__name__)

TICK_S = 0.005
_watches: set[asyncio.Task[None]] = set()  # NOTE: a task nobody holds may be collected


class Watch:
    """The ticks of one loop and the thread that looks at the loop while a tick is overdue."""

    def __init__(self, what: str, threshold_s: float, tick_s: float = TICK_S) -> None:
        self.what, self.threshold_s, self.tick_s = what, threshold_s, tick_s
        self.last_tick = time.monotonic()
        self.loop_thread = threading.get_ident()
        self._caught = 0.0  # the tick last caught overdue (each stall is caught once)
        self._stop = threading.Event()

    async def ticks(self) -> None:
        """Until cancelled: log each wake-up of this loop later than the threshold."""
        loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        threading.Thread(target=self._look, name="loop-lag", daemon=True).start()
        try:
            while True:
                slept = self.last_tick = loop.time()
                await asyncio.sleep(self.tick_s)
                woke = loop.time()
                late = woke - slept - self.tick_s
                if late > self.threshold_s:
                    log.warning(
                        "%s (pid %d): event loop woke %.1f ms late at monotonic %.3f",
                        self.what, os.getpid(), 1e3 * late, woke,
                    )  # fmt: skip
        finally:
            self._stop.set()

    def _look(self) -> None:
        while not self._stop.wait(self.tick_s):
            tick = self.last_tick
            overdue = time.monotonic() - tick - self.tick_s
            if overdue > self.threshold_s and tick != self._caught:
                self._caught = tick
                log.warning("%s", self.held(overdue))

    def held(self, overdue: float) -> str:
        """What the loop's thread runs now, and the innermost frame of every other thread."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        loop_frame = frames.get(self.loop_thread)
        stack = "".join(traceback.format_stack(loop_frame)[-12:]) if loop_frame else "  (gone)\n"
        others = [
            f"  {names.get(ident, ident)}: {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
            for ident, f in frames.items()
            if ident not in (self.loop_thread, threading.get_ident())
        ]
        return (
            f"{self.what} (pid {os.getpid()}): event loop held {1e3 * overdue:.1f} ms so far at "
            f"monotonic {time.monotonic():.3f}; its thread:\n{stack}other threads:\n"
            + "\n".join(others)
        )


def start(what: str) -> asyncio.Task[None] | None:
    """On the running loop: the watch, if the stall log is on."""
    threshold_s = stall_log_s()
    if not threshold_s:
        return None
    task = asyncio.get_running_loop().create_task(Watch(what, threshold_s).ticks())
    _watches.add(task)
    task.add_done_callback(_watches.discard)
    return task
