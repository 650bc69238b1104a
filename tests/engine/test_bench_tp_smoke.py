"""The tensor-parallel benchmark (bench/tensor_parallel.py) runs end to end at a tiny shape on
the CPU (gloo, real processes) and writes its JSON."""

from __future__ import annotations

import json

import pytest

from bench.tensor_parallel import main

pytestmark = pytest.mark.slow


def test_tensor_parallel_benchmark_smoke_run_writes_json(tmp_path):
    out = tmp_path / "tp.json"
    main(["--smoke", "--cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [row["tp"] for row in result["rows"]] == [1, 2]
    assert result["collectives"]["bus_GB_per_s"] > 0
    assert all(row["step_b1_ms"] > 0 and row["ttft_48_ms"] > 0 for row in result["rows"])
    assert result["summary"]["step_b1_speedup"] > 0
