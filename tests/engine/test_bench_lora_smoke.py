"""The multi-LoRA benchmark (bench/lora.py) runs end to end on the CPU at a tiny size and
writes its JSON: the base row first, each adapter count after it, ratios against the base."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_lora_bench_smoke_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    subprocess.run(
        [sys.executable, "-m", "bench.lora", "--smoke", "--out", str(out)],
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [r["adapters"] for r in rows] == ["base", 1, 2, 4]
    assert rows[0]["decode x base"] == rows[0]["prefill x base"] == 1.0
    for row in rows:
        assert row["decode tok/s"] > 0 and row["prefill tok/s"] > 0
    assert results["swap_in_ms"] > 0
