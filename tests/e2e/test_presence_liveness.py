"""A worker's presence follows its ability to serve, on a real redis-server: a worker whose
`info` says it is stalled (its engine loop stopped turning) leaves the registry within a
heartbeat and joins again once it serves; housekeeping that waits on a long step never
delays a heartbeat (the record would lapse, and the gateway take a busy worker for a frozen
one)."""

from __future__ import annotations

import threading
import time

from splitserve.kv_transfer.presence import Presence, Stalled
from splitserve.kv_transfer.registry import Registry, WorkerInfo

TTL_S = 0.6
INTERVAL_S = 0.1


def _ids(registry: Registry) -> list[str]:
    return [w.worker_id for w in registry.live_workers("decode")]


def _until(what, timeout_s: float = 5.0) -> float:
    """Seconds until `what()` held; fails after `timeout_s`."""
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < timeout_s, "never happened"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_stalled_worker_leaves_within_a_heartbeat_and_rejoins_when_it_serves(registry):
    info = WorkerInfo("d0", "decode", "127.0.0.1:1", num_total_blocks=8, block_size=16)
    stalled = threading.Event()
    rejoined = threading.Event()

    def current() -> WorkerInfo:
        if stalled.is_set():
            raise Stalled("its engine loop has not turned for 2.1 s")
        return info

    presence = Presence(
        registry, current, ttl_s=TTL_S, interval_s=INTERVAL_S,
        kv_endpoint={"grpc": b"127.0.0.1:2"}, on_rejoin=rejoined.set,
    ).start()  # fmt: skip
    try:
        assert _ids(registry) == ["d0"]
        stalled.set()
        # NOTE: withdrawn at the next heartbeat, well before its TTL would have lapsed
        assert _until(lambda: not _ids(registry)) < 3 * INTERVAL_S
        assert registry.kv_endpoint("d0") in (None, {})
        time.sleep(3 * TTL_S)
        assert not _ids(registry)  # stays out while stalled
        stalled.clear()
        _until(lambda: _ids(registry) == ["d0"])
        assert registry.kv_endpoint("d0") == {"grpc": b"127.0.0.1:2"}
        assert rejoined.wait(5)  # e.g. its prefix index is listed again
    finally:
        presence.stop()


def test_housekeeping_that_waits_on_a_long_step_never_lets_the_record_lapse(registry):
    info = WorkerInfo("d0", "decode", "127.0.0.1:1", num_total_blocks=8, block_size=16)
    step = threading.Event()
    ticks = []

    def housekeeping() -> None:
        ticks.append(time.monotonic())
        step.wait(5 * TTL_S)  # NOTE: as a call to an engine core in a long step waits

    presence = Presence(
        registry, lambda: info, ttl_s=TTL_S, interval_s=INTERVAL_S, on_tick=housekeeping
    ).start()
    try:
        _until(lambda: bool(ticks))
        deadline = time.monotonic() + 3 * TTL_S
        while time.monotonic() < deadline:
            assert _ids(registry) == ["d0"]
            time.sleep(0.02)
        step.set()
        _until(lambda: len(ticks) >= 2)
    finally:
        step.set()
        presence.stop()
