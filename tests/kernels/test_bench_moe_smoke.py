"""The MoE layer benchmark (bench/moe_layer.py) runs end to end on its tiny shape (Triton's
interpreter on a CPU) and writes its JSON: each token count's touched experts, the fused
path's time and bandwidth, and the baselines measured in the same run."""

from __future__ import annotations

import json

import pytest

from bench.moe_layer import main

pytestmark = pytest.mark.slow


def test_moe_layer_benchmark_quick_run_writes_json(tmp_path):
    out = tmp_path / "moe_layer.json"
    main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] and result["dtype"] and result["copy_bandwidth"]["TB_per_s"] > 0
    assert [r["T"] for r in result["rows"]] == [1, 4, 32]
    for row in result["rows"]:
        assert 1 <= row["experts"] <= result["experts"] and row["expected"] > 0
        assert row["fused us"] > 0 and row["loop us"] > 0 and row["TB/s"] > 0
    assert result["rows"][0]["experts"] == result["top_k"]  # one token: k distinct experts
