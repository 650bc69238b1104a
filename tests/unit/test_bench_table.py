"""The benchmarks' printed table: a run that failed before its first row still prints (its
error is then what the JSON holds), and columns fit their widest cell."""

from __future__ import annotations

from bench.common import table


def test_a_table_with_no_rows_prints_its_header() -> None:
    assert table([], ["request", "ttft_ms"]) == "request  ttft_ms"


def test_columns_fit_their_widest_cell() -> None:
    lines = table([{"a": 12345, "b": "x"}, {"a": 1}], ["a", "b"]).splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[1].split() == ["12345", "x"]


def test_a_step_quantile_reads_linearly_within_its_bucket():
    from bench.serving import _step_quantile_est

    inf = float("inf")
    before = {0.005: 0.0, 0.006: 10.0, 0.007: 10.0, inf: 10.0}
    # 100 steps this run: 50 in (5, 6] ms, 50 in (6, 7] ms
    after = {0.005: 0.0, 0.006: 60.0, 0.007: 110.0, inf: 110.0}
    assert _step_quantile_est(before, after, 0.5) == 6.0
    assert abs(_step_quantile_est(before, after, 0.75) - 6.5) < 1e-9
    assert abs(_step_quantile_est(before, after, 0.25) - 5.5) < 1e-9
    # all above the last finite bound: its bound, not infinity
    assert _step_quantile_est({}, {0.005: 0.0, inf: 4.0}, 0.5) == 5.0


def test_serving_steps_count_the_long_turns_of_the_run_only():
    from bench.serving import serving_steps

    inf = float("inf")
    before = {"d": {"num_steps": 10, "num_step_seqs": 100, "step_seconds": 0.1,
                    "buckets": {0.01: 8, 0.025: 9, inf: 10}}}  # fmt: skip
    after = {"d": {"num_steps": 110, "num_step_seqs": 1100, "step_seconds": 1.1,
                   "buckets": {0.01: 100, 0.025: 106, inf: 110}}}  # fmt: skip
    (step,) = serving_steps(before, after).values()
    assert step["steps"] == 100 and step["steps_over_25ms"] == 3  # 100 - (106 - 9)
