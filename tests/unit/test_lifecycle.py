"""A service's gated servicers: UNAVAILABLE "loading" until bound, admission refused while
draining (other calls go on), and calls in flight (streams included) counted for the drain."""

from __future__ import annotations

import threading

import pytest

from splitserve.engine.errors import Unavailable
from splitserve.runtime.lifecycle import Lifecycle, State


class Worker:
    def Reserve(self, request, context):
        return f"reserved {request}"

    def Decode(self, request, context):
        yield from range(request)


def test_methods_answer_unavailable_loading_until_the_servicer_is_bound():
    lifecycle = Lifecycle(["svc"])
    gate = lifecycle.gate(admitting=["Reserve"])
    with pytest.raises(Unavailable, match="^loading$"):
        gate.Reserve("r", None)
    gate.bind(Worker())
    lifecycle.set_serving()
    assert gate.Reserve("r", None) == "reserved r"
    assert list(gate.Decode(3, None)) == [0, 1, 2]


def test_draining_refuses_new_work_but_lets_running_streams_finish():
    lifecycle = Lifecycle(["svc"])
    gate = lifecycle.gate(admitting=["Reserve"])
    gate.bind(Worker())
    lifecycle.set_serving()
    stream = gate.Decode(3, None)
    assert next(stream) == 0
    assert lifecycle.num_busy() == 1
    lifecycle.start_draining()
    assert lifecycle.state is State.DRAINING
    with pytest.raises(Unavailable, match="draining"):
        gate.Reserve("late", None)
    assert not lifecycle.wait_idle(0.1)
    assert list(stream) == [1, 2]  # the running call is not cut
    assert lifecycle.num_busy() == 0 and lifecycle.wait_idle(0.1)


def test_drain_also_waits_for_registered_pending_work_or_an_interrupt():
    lifecycle = Lifecycle(["svc"])
    pending = [1]
    lifecycle.also_wait_for(lambda: len(pending))
    interrupt = threading.Event()
    threading.Timer(0.1, interrupt.set).start()
    assert not lifecycle.wait_idle(30, interrupt)
    pending.clear()
    assert lifecycle.wait_idle(0.1)
