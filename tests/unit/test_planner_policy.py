"""The planner's decision on synthetic and recorded signal sequences: prefill-bound moves a decode
worker to prefill, decode-bound the other way, steady or noisy traffic never flaps, and a side
never goes below one worker."""

from __future__ import annotations

import pytest

from splitserve.roles.planner import HistogramWindow, bucket_quantile
from splitserve.roles.planner_policy import PlannerConfig, Signals, decide

SLO = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.015, min_dwell_s=30.0)


def _run(sequence: list[dict], num_prefill: int = 2, num_decode: int = 2) -> list[tuple]:
    """Feed snapshots every 2 s, applying each move as the planner would; the split each time."""
    last, split = None, []
    for i, fields in enumerate(sequence):
        s = Signals(at_s=2.0 * i, num_prefill=num_prefill, num_decode=num_decode, **fields)
        d = decide(s, SLO, last)
        if d.move is not None:
            last, num_prefill, num_decode = s.at_s, d.num_prefill, d.num_decode
        split.append((num_prefill, num_decode))
    return split


def test_prefill_bound_traffic_moves_decode_workers_to_prefill_one_dwell_apart():
    # long prompts: TTFT far over, decode idle
    split = _run([{"ttft_p90_s": 3.0, "tpot_p90_s": 0.004}] * 40)
    assert split[0] == (3, 1)  # the first snapshot moves one
    assert split[14] == (3, 1)  # then dwells 30 s
    assert split[-1] == (3, 1)  # and never takes decode's last worker


def test_decode_bound_traffic_moves_prefill_workers_to_decode():
    split = _run([{"ttft_p90_s": 0.2, "tpot_p90_s": 0.030}] * 5, num_prefill=3, num_decode=1)
    assert split[0] == (2, 2)


def test_kv_usage_alone_makes_decode_the_short_side():
    split = _run([{"decode_kv_usage": 0.97}], num_prefill=2, num_decode=2)
    assert split == [(1, 3)]


def test_queued_prompt_tokens_alone_make_prefill_the_short_side():
    split = _run([{"prefill_queued_tokens": 2 * 40_000}], num_prefill=2, num_decode=2)
    assert split == [(3, 1)]


def test_steady_traffic_within_the_slo_never_moves():
    noisy = [{"ttft_p90_s": 0.5 + 0.4 * (i % 2), "tpot_p90_s": 0.010 + 0.004 * (i % 3 == 0)}
             for i in range(100)]  # fmt: skip
    assert set(_run(noisy)) == {(2, 2)}


def test_a_move_that_would_make_the_other_side_short_is_not_made():
    # both sides hot: moving either way only moves the problem (the flapping case)
    both = [{"ttft_p90_s": 1.6, "tpot_p90_s": 0.012}] * 50
    assert set(_run(both)) == {(2, 2)}


def test_a_phase_change_turns_the_split_around_after_the_dwell():
    # recorded shape of a phased run: prefill-bound for 60 s, then decode-bound
    seq = [{"ttft_p90_s": 2.5, "tpot_p90_s": 0.005}] * 30
    seq += [{"ttft_p90_s": 0.3, "tpot_p90_s": 0.035}] * 60
    split = _run(seq)
    assert split[29] == (3, 1)
    assert split[-1] == (1, 3)
    changes = sum(1 for a, b in zip(split, split[1:], strict=False) if a != b)
    assert changes == 2  # 3:1 -> 2:2 -> 1:3, each after a dwell, nothing back and forth


def test_no_signal_at_all_is_no_move():
    assert _run([{}] * 10) == [(2, 2)] * 10


@pytest.mark.parametrize(
    "fields", [{"ttft_slo_s": 0}, {"tpot_slo_s": -1}, {"kv_usage_high": 1.5}, {"min_dwell_s": -1}]
)
def test_a_bad_config_is_refused(fields):
    with pytest.raises(ValueError):
        PlannerConfig(**{"ttft_slo_s": 1.0, "tpot_slo_s": 0.02, **fields})


def test_bucket_quantile_interpolates_within_the_bucket_and_is_none_when_empty():
    buckets = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.1)
    assert bucket_quantile(buckets, 0.95) == pytest.approx(0.75)
    assert bucket_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.9) is None


def test_histogram_window_reads_only_what_was_observed_since_the_last_read():
    def page(fast: int, slow: int) -> str:
        name = "splitserve:time_to_first_token_seconds"
        return (
            f"# TYPE {name} histogram\n"
            f'{name}_bucket{{le="0.1"}} {fast}\n{name}_bucket{{le="2.0"}} {fast + slow}\n'
            f'{name}_bucket{{le="+Inf"}} {fast + slow}\n'
            f"{name}_count {fast + slow}\n{name}_sum 0\n"
        )

    window = HistogramWindow("splitserve:time_to_first_token_seconds")
    assert window.read([page(100, 0)]) == pytest.approx(0.09)
    assert window.read([page(100, 10)]) > 1.0  # the last window was all slow
    assert window.read([page(100, 10)]) is None  # nothing new
