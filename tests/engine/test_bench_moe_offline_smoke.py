"""The MoE offline benchmark (bench/moe_offline.py) runs its three paths end to end on a tiny
shape and writes its JSON (on a CPU every path is the reference loop, so only the shape of the
result is checked here; the figures come from a GPU)."""

from __future__ import annotations

import json

import pytest

from bench.moe_offline import main

pytestmark = pytest.mark.slow


def test_moe_offline_benchmark_quick_run_writes_json(tmp_path):
    out = tmp_path / "moe_offline.json"
    main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["path"] for r in result["rows"]] == [
        "fused + graphs",
        "fused, eager",
        "per-expert loop",
    ]
    assert all(r["tok/s"] > 0 for r in result["rows"])
    assert result["rows"][-1]["x loop"] == 1
    assert result["workload"]["ignore_eos"] is True
