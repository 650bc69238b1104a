"""The gateway's routing policy (gateway/router.py): a prefill worker is chosen by the work it
has before this prompt's first token, its queue less what of the prompt it already caches; a
decode worker by its load less its cached prefix blocks; a block in a worker's host-memory tier
counts `--host-block-weight` of one on its GPU."""

from __future__ import annotations

import argparse

import pytest

from splitserve.gateway.router import LeastLoadedPrefixAware, NoWorkerError, prefix_scores
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.runtime.settings import GatewaySettings, add_flags, from_args


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


# -- a worker's host-memory KV tier ----------------------------------------------------------


def test_a_host_tier_block_counts_its_weight_of_a_gpu_block():
    # (leading blocks on the GPU, leading blocks on the GPU then in the host tier)
    tiers = {"gpu": (10, 10), "host": (0, 12), "mixed": (4, 10)}
    assert prefix_scores(tiers, 0.9) == pytest.approx({"gpu": 10, "host": 10.8, "mixed": 9.4})
    assert prefix_scores(tiers, 0.0) == {"gpu": 10, "host": 0, "mixed": 4}
    assert prefix_scores(tiers, 1.0) == {"gpu": 10, "host": 12, "mixed": 10}


def test_more_host_blocks_beat_fewer_gpu_blocks_only_when_they_save_more():
    gpu, host = worker("gpu", "decode"), worker("host", "decode")
    more_on_host = prefix_scores({"gpu": (10, 10), "host": (0, 12)}, 0.9)  # 10 vs 10.8
    assert POLICY.pick_decode([gpu, host], {}, more_on_host).worker_id == "host"
    as_many_on_host = prefix_scores({"gpu": (10, 10), "host": (0, 11)}, 0.9)  # 10 vs 9.9
    assert POLICY.pick_decode([gpu, host], {}, as_many_on_host).worker_id == "gpu"
    ignored = prefix_scores({"gpu": (10, 10), "host": (0, 12)}, 0.0)
    assert POLICY.pick_decode([gpu, host], {}, ignored).worker_id == "gpu"


def test_a_prefill_workers_host_blocks_count_as_weighted_cached_tokens():
    scores = prefix_scores({"a": (100, 100), "b": (0, 120)}, 0.9)  # blocks of 16 tokens
    cached = {w: n * 16 for w, n in scores.items()}  # a: 1,600, b: 1,728
    assert POLICY.pick_prefill([A, B], {}, cached).worker_id == "b"
    assert POLICY.pick_prefill([A, B], {"b": 200}, cached).worker_id == "a"  # 1,528 < 1,600


@pytest.mark.parametrize("weight", [-0.1, 1.5, float("nan")])
def test_a_host_block_weight_outside_0_to_1_names_the_flag(weight):
    with pytest.raises(ValueError, match="--host-block-weight must be 0 to 1"):
        GatewaySettings(host_block_weight=weight)


def test_the_host_block_weight_flag_reaches_the_gateways_settings():
    parser = argparse.ArgumentParser()
    add_flags(parser, GatewaySettings, {})
    assert from_args(GatewaySettings, parser.parse_args([])).host_block_weight == 0.9
    args = parser.parse_args(["--host-block-weight", "0.5"])
    assert from_args(GatewaySettings, args).host_block_weight == 0.5
