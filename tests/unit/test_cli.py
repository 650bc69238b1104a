"""The console command, run as a real process."""

from __future__ import annotations

import subprocess
import sys


def _splitserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_make_tiny_model_then_offline_generate(tmp_path):
    made = _splitserve("make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3")
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    run = _splitserve("offline", "--model", str(tmp_path / "m"), "--max-tokens", "8", "Hello")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


def test_bad_model_dir_is_a_clear_error(tmp_path):
    run = _splitserve("offline", "--model", str(tmp_path / "missing"), "hi")
    assert run.returncode == 2
    assert "does not exist" in run.stderr


def test_a_worker_whose_kv_pool_cannot_hold_one_full_context_says_so_at_start(tmp_path):
    made = _splitserve("make-tiny-model", str(tmp_path / "m"))
    assert made.returncode == 0, made.stderr
    run = _splitserve(
        "decode", "--model", str(tmp_path / "m"), "--redis-url", "redis://127.0.0.1:9",
        "--num-kv-blocks", "4", "--device", "cpu",
    )  # fmt: skip
    assert run.returncode == 2
    assert "KV pool holds 4 blocks (64 tokens)" in run.stderr
    assert "lower --max-model-len" in run.stderr
