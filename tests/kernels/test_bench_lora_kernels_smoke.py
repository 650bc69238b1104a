"""The LoRA kernel benchmark (bench/lora_kernels.py) runs on the CPU at a tiny size (Triton's
interpreter) and writes its JSON: the base row first, then each adapter count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_lora_kernels_bench_smoke_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "lora_kernels.json"
    subprocess.run(
        [sys.executable, "-m", "bench.lora_kernels", "--smoke", "--out", str(out)],
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    results = json.loads(out.read_text())
    assert [r["adapters"] for r in results["rows"]] == ["base", 1, 1, 2, 2]
    assert [r.get("kernels") for r in results["rows"]][1:3] == ["grouped", "per-row"]
    assert all(r["step ms"] > 0 for r in results["rows"])
