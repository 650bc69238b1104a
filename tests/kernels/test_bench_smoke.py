"""The kernel benchmark (bench/kernels.py) runs end to end on tiny shapes and writes its JSON."""

from __future__ import annotations

import json

import pytest

from bench.kernels import main

pytestmark = pytest.mark.slow


def test_kernel_benchmark_smoke_run_writes_json(tmp_path):
    out = tmp_path / "kernels.json"
    main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] and result["dtype"] and result["copy_bandwidth"]["GB_per_s"] > 0
    decode_rows = [r for r in result["decode"]["rows"] if "skipped" not in r]
    assert decode_rows and all(r["GB_per_s"] > 0 and r["num_splits"] >= 1 for r in decode_rows)
    assert all(r["TFLOP_per_s"] > 0 for r in result["prefill"]["rows"])
