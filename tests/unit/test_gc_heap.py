"""The serving processes' garbage-collector settings (runtime/gc_heap.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from splitserve.runtime.gc_heap import FREEZE_ENV, GCPauses

# NOTE: in a child process: freezing is process-wide and would keep this test process's heap.
_FREEZE = """
import gc
from splitserve.runtime.gc_heap import freeze_startup_heap
keep = [[i] for i in range(50_000)]
frozen = freeze_startup_heap("test")
print(frozen, gc.get_freeze_count())
"""


def _freeze(env_value: str | None) -> tuple[int, int]:
    env = dict(os.environ)
    env.pop(FREEZE_ENV, None)
    if env_value is not None:
        env[FREEZE_ENV] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _FREEZE], env=env, capture_output=True, text=True, check=True
    )
    frozen, count = out.stdout.split()
    return int(frozen), int(count)


def test_the_start_up_heap_is_frozen_out_of_collections():
    frozen, count = _freeze(None)
    assert frozen == count
    assert frozen > 50_000  # the 50k lists kept, and the interpreter's own start-up state


def test_freezing_can_be_turned_off_to_measure_it():
    assert _freeze("0") == (0, 0)


def test_every_collection_is_timed_by_generation():
    pauses = GCPauses("test").install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    summary = pauses.summary()
    assert summary["gen0"]["collections"] >= 1
    assert summary["gen2"]["collections"] >= 1
    assert pauses.total_s[2] >= pauses.max_s[2] > 0
    assert pauses._on_gc not in gc.callbacks
