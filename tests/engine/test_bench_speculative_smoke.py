"""The speculative decoding benchmark (bench/speculative.py) runs end to end on the CPU at tiny
size and writes its JSON: both parts, every configuration against its plain baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_speculative_bench_smoke_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "speculative.json"
    subprocess.run(
        [sys.executable, "-m", "bench.speculative", "--smoke", "--out", str(out)],
        check=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    results = json.loads(out.read_text())
    rows = results["draft_model_rows"]
    assert {r["config"] for r in rows} >= {"plain", "draft k=4 corrupt=1.0"}
    for row in rows:
        assert row["ITL ms"] > 0 and row["speedup"] > 0 and row["tokens/step"] >= 1
    nothing = [r for r in rows if r["config"] == "draft k=4 corrupt=1.0"]
    assert all(r["acceptance"] < 0.05 for r in nothing)  # corrupted drafts: acceptance ~0
    workloads = {r["workload"] for r in results["ngram_rows"]}
    assert workloads == {"repeat passage", "edit passage", "free chat"}
