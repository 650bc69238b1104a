"""The tensor-parallel benchmark (bench/tensor_parallel.py) runs end to end at a tiny shape on
the CPU (gloo, real processes) and writes its JSON; a row that fails or runs past its time
limit is recorded with its error, and leaves no process behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.row_process import run_row
from bench.tensor_parallel import main

pytestmark = pytest.mark.slow


def _row_spec(model: str, **over) -> dict:
    spec = {
        "name": "TP=2",
        "model": model,
        "on_gpu": False,
        "tp": 2,
        "graphs": True,
        "tp_graphs": False,
        "prompt_lens": [48],
        "batches": [1],
        "context": 32,
        "steps": 2,
        "reps": 1,
        "num_kv_blocks": 64,
    }
    return {**spec, **over}


def _processes_naming(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and b"pytest" not in cmdline:
            found.append(int(proc.name))
    return found


def test_tensor_parallel_benchmark_smoke_run_writes_json(tmp_path, capsys):
    out = tmp_path / "tp.json"
    main(["--smoke", "--cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [row["tp"] for row in result["rows"]] == [1, 2]
    assert not any("error" in row for row in result["rows"])
    assert result["collectives"]["bus_GB_per_s"] > 0
    assert all(row["step_b1_ms"] > 0 and row["ttft_48_ms"] > 0 for row in result["rows"])
    assert result["rows"][1]["step_b1_speedup"] > 0
    assert set(result["checks"]["TP=2"]) == {"decode b1 >= 1.5x"}  # no 4k prompt, no floor
    printed = capsys.readouterr().out
    # every phase as it ends, timestamped: the collectives, each row's engine and steps
    assert "collectives: bus" in printed and "TP=2: engine up in" in printed
    assert "tensor-parallel: 2 ranks joined (gloo)" in printed


def test_a_row_past_its_time_limit_is_killed_with_its_followers_and_recorded(tiny_models):
    model = str(tiny_models["llama"])
    row = run_row(_row_spec(model, reps=10**9), timeout_s=40.0)  # TTFT forever
    assert row["error"].startswith("timed out after 40 s")
    assert _processes_naming(model) == []  # the row and its follower rank are gone


def test_a_row_that_fails_is_recorded_with_its_error(tmp_path):
    row = run_row(_row_spec(str(tmp_path / "no-such-model")), timeout_s=120.0)
    assert row["error"].startswith("exit code 1")
    assert "no-such-model" in row["error"]


def test_serve_mode_smoke_run_serves_through_the_gateway_at_tp2(tmp_path, capsys):
    out = tmp_path / "serve.json"
    main(["--serve", "--smoke", "--cpu", "--prefill", "0", "--decode-tp", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["error"] is None
    assert [row["tokens"] for row in result["rows"]] == [8, 8]
    assert "serve: stack ready in" in capsys.readouterr().out
