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
    all_rows = results["draft_model_rows"]
    assert not [r for r in all_rows if "error" in r]
    rows = [r for r in all_rows if "ITL ms" in r]
    assert {r["config"] for r in rows} >= {
        "plain", "draft k=4 corrupt=0.0", "draft k=4 corrupt=0.0 eager", "draft k=4 corrupt=1.0"
    }  # fmt: skip
    for row in rows:
        assert row["ITL ms"] > 0 and row["speedup"] > 0 and row["tokens/step"] >= 1
    nothing = [r for r in rows if r["config"] == "draft k=4 corrupt=1.0"]
    # Corrupted drafts: acceptance ~0 (few drafts, as the backoff pauses them: a lucky one
    # weighs a few percent).
    assert all(r["acceptance"] < 0.2 for r in nothing)
    # The quiet deep layers make the truncated draft agree with the target: acceptance ~1.
    agree = [r for r in rows if r["config"].startswith("draft k=4 corrupt=0.0")]
    assert agree and all(r["acceptance"] > 0.9 for r in agree)
    pd = [r for r in all_rows if "P/D 2nd token ms" in r]
    assert {r["config"] for r in pd} >= {
        "plain", "draft k=4 corrupt=0.0", "draft checkpoint P/D k=4"
    }  # fmt: skip
    assert not [r for r in rows if r["config"].startswith("draft checkpoint")]  # P/D only
    assert all(r["P/D 2nd token ms"] > 0 for r in pd)
    workloads = {r["workload"] for r in results["ngram_rows"]}
    assert workloads == {"repeat passage", "edit passage", "free chat"}
