"""The stall log (`SPLITSERVE_STALL_LOG_MS`): an engine turn or an event-loop wake-up over the
threshold is logged with its parts and monotonic time; under it, or with the log off, nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterator

import pytest

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.stall_log import stall_log_s
from splitserve.runtime import loop_lag
from tests.unit.test_async_waits import FakeEngine


def test_the_threshold_is_read_in_milliseconds_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_STALL_LOG_MS", raising=False)
    assert stall_log_s() == 0.0
    monkeypatch.setenv("SPLITSERVE_STALL_LOG_MS", "25")
    assert stall_log_s() == pytest.approx(0.025)
    monkeypatch.setenv("SPLITSERVE_STALL_LOG_MS", "fast")
    with pytest.raises(ValueError, match="SPLITSERVE_STALL_LOG_MS must be a number"):
        stall_log_s()


class SlowCommandEngine(FakeEngine):
    slow_step_in = 0  # steps until one that takes 80 ms

    def hold(self, seconds: float) -> None:
        time.sleep(seconds)

    def step(self):
        self.slow_step_in -= 1
        if self.slow_step_in == 0:
            time.sleep(0.08)
        return super().step()


@contextlib.contextmanager
def _engine_loop(monkeypatch, caplog, log_ms: str | None) -> Iterator[EngineLoop]:
    """An engine loop over `SlowCommandEngine` with the stall log at `log_ms` (None: off),
    running one request; its warnings captured."""
    if log_ms is None:
        monkeypatch.delenv("SPLITSERVE_STALL_LOG_MS", raising=False)
    else:
        monkeypatch.setenv("SPLITSERVE_STALL_LOG_MS", log_ms)
    loop = EngineLoop(SlowCommandEngine(steps=1000), idle_wait_s=0.01).start()  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.WARNING, logger="splitserve.engine.engine_loop"):
            loop.call(lambda e: e.add("r0"))
            yield loop
    finally:
        loop.stop()


def _turn_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "slow engine turn" in r.getMessage()]


def test_a_slow_turn_is_logged_with_its_slowest_command(monkeypatch, caplog):
    with _engine_loop(monkeypatch, caplog, "40") as loop:
        time.sleep(0.1)  # steps of 5 ms: none logged
        assert _turn_logs(caplog) == []
        before = time.monotonic()
        loop.call(lambda e: e.hold(0.08))
        time.sleep(0.05)
        after = time.monotonic()
    (line,) = _turn_logs(caplog)
    match = re.search(r"turn ([\d.]+) ms at monotonic ([\d.]+): 1 commands ([\d.]+) ms", line)
    assert match, line
    assert float(match[1]) >= 80 and float(match[3]) >= 80
    assert before <= float(match[2]) <= after
    assert "slowest command" in line and "<lambda>" in line and "(1 sequences)" in line


def test_a_slow_step_after_a_command_is_logged_without_that_command(monkeypatch, caplog):
    with _engine_loop(monkeypatch, caplog, "40") as loop:
        loop.call(lambda e: setattr(e, "slow_step_in", 3))  # a later turn, no command in it
        time.sleep(0.15)
    (line,) = _turn_logs(caplog)
    step = re.search(r"step ([\d.]+) ms", line)
    assert step and float(step[1]) >= 80, line
    assert ": 0 commands" in line and "slowest command - 0.0 ms" in line, line


def test_a_turn_is_not_logged_with_the_log_off(monkeypatch, caplog):
    with _engine_loop(monkeypatch, caplog, None) as loop:
        loop.call(lambda e: e.hold(0.08))
        time.sleep(0.05)
    assert _turn_logs(caplog) == []


def test_a_blocked_event_loop_is_logged_with_how_late_it_woke_and_what_held_it(monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_STALL_LOG_MS", "30")

    async def scenario() -> tuple[float, float]:
        task = loop_lag.start("test service")
        assert task is not None
        await asyncio.sleep(0.05)
        before = time.monotonic()
        time.sleep(0.08)  # a handler that blocks the loop
        await asyncio.sleep(0.05)
        task.cancel()
        return before, time.monotonic()

    with caplog.at_level(logging.WARNING, logger="splitserve.runtime.loop_lag"):
        before, after = asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if "event loop woke" in r.getMessage()]
    assert len(lines) == 1, lines
    (held,) = [r.getMessage() for r in caplog.records if "event loop held" in r.getMessage()]
    assert "in scenario" in held and "time.sleep(0.08)" in held, held  # the loop's own stack
    assert "other threads:" in held
    match = re.search(r"test service \(pid \d+\): event loop woke ([\d.]+) ms late at "
                      r"monotonic ([\d.]+)", lines[0])  # fmt: skip
    assert match, lines[0]
    assert 50 <= float(match[1]) <= 1000 and before <= float(match[2]) <= after


def test_no_watch_runs_with_the_log_off(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_STALL_LOG_MS", raising=False)

    async def scenario() -> None:
        assert loop_lag.start("test service") is None

    asyncio.run(scenario())
