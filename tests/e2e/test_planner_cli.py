"""`splitserve planner` as a process: it reads the registry every interval, logs each snapshot and
decision as a JSON line, and stops cleanly on SIGTERM; a bad SLO is a one-line error."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest


def _planner(redis_url: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "planner", "--redis-url", redis_url, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_planner_logs_snapshots_and_decisions_and_stops_on_sigterm(redis_server, tmp_path):
    log = tmp_path / "planner.jsonl"
    proc = _planner(
        redis_server.url, "--ttft-slo-s", "1", "--tpot-slo-s", "0.015", "--interval-s", "0.2",
        "--dry-run", "--log-json", str(log),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no snapshot logged"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "planner holding TTFT <= 1.0 s, TPOT <= 0.015 s" in out
    line = json.loads(log.read_text().splitlines()[0])
    assert (line["num_prefill"], line["num_decode"], line["move"]) == (0, 0, None)
    assert line["reason"] == "both sides within the SLO"


@pytest.mark.parametrize("slo", [["--ttft-slo-s", "0", "--tpot-slo-s", "0.015"]])
def test_a_bad_slo_is_a_one_line_error(redis_server, slo):
    proc = _planner(redis_server.url, *slo)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip() == "splitserve planner: error: ttft_slo_s must be > 0, got 0.0"
