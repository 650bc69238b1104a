"""The console command, run as a real process."""

from __future__ import annotations

import os
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


def _splitserve_env(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_an_invalid_port_is_refused_before_anything_starts():
    for args in (
        ("up", "--port", "99999"),
        ("gateway", "--model", "m", "--redis-url", "redis://127.0.0.1:9", "--port", "99999"),
    ):
        run = _splitserve(*args)
        assert run.returncode == 2, (args, run.stderr)
        assert "--port must be a TCP port, 0 to 65535" in run.stderr
        assert "Traceback" not in run.stderr


def test_a_bad_environment_value_is_a_clear_error():
    for env, says in (
        ({"SPLITSERVE_LEASE_S": "soon"}, "SPLITSERVE_LEASE_S='soon'"),
        ({"SPLITSERVE_LOG_LEVEL": "loud"}, "SPLITSERVE_LOG_LEVEL='loud'"),
    ):
        run = _splitserve_env(env, "generate", "hi")
        assert run.returncode == 2, run.stderr
        assert says in run.stderr and "Traceback" not in run.stderr


def test_generate_against_an_unreachable_address_is_a_clear_error():
    for address in ("127.0.0.1:9", "no-such-host.invalid:50051"):
        run = _splitserve("generate", "hi", "--address", address, "--timeout", "20")
        assert run.returncode == 1, run.stderr
        assert f"cannot reach a gateway at {address}" in run.stderr
        assert "Traceback" not in run.stderr and len(run.stderr) < 1000
