"""The structured-outputs benchmark (bench/structured.py) runs on tiny shapes and writes JSON."""

from __future__ import annotations

import json

from bench.structured import main


def test_structured_benchmark_smoke_run_writes_json(tmp_path):
    out = tmp_path / "structured.json"
    main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] and result["num_constrained"] == result["batch"] // 2
    assert {r["sampling"] for r in result["rows"]} == {"greedy", "sampled"}
    for row in result["rows"]:
        assert row["free_ms"] > 0 and row["half_constrained_ms"] > 0
    assert result["breakdown"]["fill_ms"] > 0 and result["breakdown"]["fill_and_apply_ms"] > 0
