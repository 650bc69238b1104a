"""The gateway's routing policy (gateway/router.py): a prefill worker is chosen by the work it
has before this prompt's first token, its queue less what of the prompt it already caches; a
decode worker by its load less its cached prefix blocks."""

from __future__ import annotations

import pytest

from splitserve.gateway.router import LeastLoadedPrefixAware, NoWorkerError
from splitserve.kv_transfer.registry import WorkerInfo


def worker(worker_id: str, kind: str = "prefill", load: int = 0) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, kind=kind, address="127.0.0.1:1", num_free_blocks=100,
        num_total_blocks=100, load=load,
    )  # fmt: skip


POLICY = LeastLoadedPrefixAware()
A, B = worker("a"), worker("b")


def test_a_prefill_worker_that_caches_the_prompts_start_wins_at_equal_queues():
    assert POLICY.pick_prefill([A, B], {}, {"b": 4096}).worker_id == "b"


def test_a_cached_prefix_outweighs_a_queue_shorter_than_it():
    queued = {"a": 0, "b": 3000}  # b must first finish 3,000 queued tokens ...
    assert POLICY.pick_prefill([A, B], queued, {"b": 4096}).worker_id == "b"  # ... saves 4,096


def test_a_queue_longer_than_the_cached_prefix_sends_the_prompt_elsewhere():
    queued = {"a": 0, "b": 5000}
    assert POLICY.pick_prefill([A, B], queued, {"b": 4096}).worker_id == "a"


def test_without_cache_information_the_shortest_queue_wins():
    assert POLICY.pick_prefill([A, B], {"a": 10, "b": 2}).worker_id == "b"
    assert POLICY.pick_prefill([A, B], {}).worker_id == "a"  # ties: by id


def test_no_prefill_worker_is_unavailable():
    with pytest.raises(NoWorkerError):
        POLICY.pick_prefill([], {}, {})


def test_a_decode_workers_cached_blocks_take_load_off():
    busy, idle = worker("busy", "decode", load=3), worker("idle", "decode", load=1)
    assert POLICY.pick_decode([busy, idle], {}, {}).worker_id == "idle"
    assert POLICY.pick_decode([busy, idle], {}, {"busy": 8}).worker_id == "busy"
