"""The heartbeat's view of the engine loop: the newest stats without waiting on a step, and
`Stalled` once a question has gone unanswered for `stall_s`."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future

import pytest

from splitserve.engine.stats import EngineStats
from splitserve.kv_transfer.presence import Stalled
from splitserve.runtime.engine_watch import EngineWatch


def _reply(num_running: int) -> dict:
    """A core's answer to "stats" (EngineStats' fields, as they cross the core's door)."""
    names = [f.name for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING]
    return {**dict.fromkeys(names, 0), "num_requests_running": num_running}


class Core:
    """Answers "stats" only when the test says so (a step in progress holds the answer)."""

    def __init__(self) -> None:
        self.asked: list[Future] = []

    def ask(self) -> Future:
        self.asked.append(Future())
        return self.asked[-1]


def _first(core: Core, watch: EngineWatch) -> EngineStats:
    """The first call waits for the core's first answer."""
    got: list[EngineStats] = []
    waiter = threading.Thread(target=lambda: got.append(watch.latest(first_timeout_s=5)))
    waiter.start()
    while not core.asked:
        time.sleep(0.001)
    core.asked[0].set_result(_reply(1))
    waiter.join(5)
    return got[0]


def test_the_heartbeat_gets_the_last_answer_while_a_long_step_holds_the_next():
    now = [0.0]
    core = Core()
    watch = EngineWatch(core.ask, stall_s=2.0, clock=lambda: now[0])
    assert _first(core, watch).num_requests_running == 1
    now[0] = 1.0
    assert watch.latest().num_requests_running == 1  # a new question went out; not answered
    assert len(core.asked) == 2
    now[0] = 2.9  # 1.9 s into the step: not yet a stall
    assert watch.latest().num_requests_running == 1
    assert len(core.asked) == 2  # one question in flight at a time
    core.asked[1].set_result(_reply(7))
    now[0] = 3.5
    assert watch.latest().num_requests_running == 7


def test_a_question_unanswered_for_stall_s_is_a_stall_until_the_loop_turns_again():
    now = [0.0]
    core = Core()
    watch = EngineWatch(core.ask, stall_s=2.0, clock=lambda: now[0])
    _first(core, watch)
    now[0] = 1.0
    watch.latest()
    now[0] = 3.1
    with pytest.raises(Stalled, match="has not turned for 2.1 s"):
        watch.latest()
    with pytest.raises(Stalled):
        watch.latest()
    core.asked[1].set_result(_reply(3))  # the loop turned again
    assert watch.latest().num_requests_running == 3


def test_a_core_that_failed_the_question_raises_its_error():
    now = [0.0]
    core = Core()
    watch = EngineWatch(core.ask, stall_s=2.0, clock=lambda: now[0])
    _first(core, watch)
    watch.latest()
    core.asked[1].set_exception(RuntimeError("the engine core exited"))
    with pytest.raises(RuntimeError, match="exited"):
        watch.latest()


def test_stall_s_must_be_positive():
    with pytest.raises(ValueError, match="stall_s"):
        EngineWatch(Core().ask, stall_s=0)


def test_a_loop_whose_turns_take_long_lately_is_given_three_times_as_long():
    """Answers that took 1.5 s (long steps on a busy CPU) pace the deadline to 4.5 s, decaying
    (half-life 10 s) while no longer answer comes: a 2.5 s wait is no stall, a 4 s one is."""
    now = [0.0]
    core = Core()
    watch = EngineWatch(core.ask, stall_s=2.0, clock=lambda: now[0])
    _first(core, watch)
    watch.latest()  # asked at 0
    now[0] = 1.5
    core.asked[1].set_result(_reply(2))  # the step held the answer 1.5 s
    watch.latest()  # the answer is read; a new question asked at 1.5
    assert watch.deadline_s == pytest.approx(4.5, abs=0.01)
    assert watch.pace_s == pytest.approx(1.5)  # what the worker advertises to the gateways
    now[0] = 1.5 + 2.5
    assert watch.latest().num_requests_running == 2  # a long step, not a freeze
    now[0] = 1.5 + 4.0  # the peak has decayed to 1.5 * 0.5 ** 0.4: a deadline of 3.4 s
    with pytest.raises(Stalled, match="paced to 3.4 s"):
        watch.latest()


def test_a_fast_loop_that_freezes_is_caught_at_stall_s():
    now = [0.0]
    core = Core()
    watch = EngineWatch(core.ask, stall_s=2.0, clock=lambda: now[0])
    _first(core, watch)
    for i in range(1, 20):  # answered within 20 ms every time
        now[0] = i * 0.5
        watch.latest()
        now[0] += 0.02
        core.asked[-1].set_result(_reply(1))
    now[0] += 0.5
    watch.latest()  # the last question, never answered
    assert watch.deadline_s == 2.0
    now[0] += 2.1
    with pytest.raises(Stalled):
        watch.latest()
