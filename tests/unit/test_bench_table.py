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
