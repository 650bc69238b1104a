"""The FP8 accuracy benchmark (bench/fp8_accuracy.py) runs end to end on the CPU and writes its
JSON: every pair compared, the numbers in range."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_fp8_accuracy_smoke_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "fp8_accuracy.json"
    subprocess.run(
        [sys.executable, "-m", "bench.fp8_accuracy", "--smoke", "--out", str(out)],
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["a / reference"] for r in rows] == [
        "bf16 / float32",
        "fp8 / bf16",
        "fp8 / float32",
        "fp8 KV / bf16",
        "fp8 KV / float32",
    ]
    for row in rows:
        assert row["positions compared"] > 0
        assert 0 <= row["logprob err mean"] <= row["logprob err max"] < 1.0
        assert 0 <= row["greedy agreement %"] <= 100
