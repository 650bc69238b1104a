"""The serving benchmark (bench/serving.py) runs end to end on the CPU: both configurations
start as real stacks, every request completes, and the JSON holds each run's figures."""

from __future__ import annotations

import json

import pytest

from bench import itl_gaps
from bench.serving import main

pytestmark = pytest.mark.slow


def test_serving_benchmark_smoke_run_completes_every_request_and_writes_json(tmp_path):
    out, records = tmp_path / "serving.json", tmp_path / "records.jsonl.gz"
    main(["--smoke", "--out", str(out), "--records-out", str(records)])
    result = json.loads(out.read_text())
    runs = [r for r in result["results"] if "rate" in r]
    assert {r["config"] for r in runs} == {"1P+1D", "2 colocated"}
    for run in runs:
        assert run["ok"] == run["requests"] > 0 and not run["errors"]
        assert run["ttft_p50_s"] > 0 and run["output_tokens_per_s"] > 0
        assert 0 <= run["slo_attainment"] <= 1
    # every run's requests and token times, which bench/itl_gaps.py reads
    rows = itl_gaps.main([str(records), "--threshold-ms", "0"])
    assert len(rows) == len(runs)
    for row, run in zip(rows, runs, strict=True):
        assert row["rate"] == run["rate"] and row["messages"] > 0
        assert row["long_gaps"] == row["messages"]  # every gap is over 0 ms
