"""The relay benchmark (bench/relay.py) runs end to end on the CPU: fake workers registered in a
real Redis, the real gateway with 2 processes on one port, client processes, one and four tokens
per client message; every row relays tokens without errors (a process still loading takes no
connection) and the JSON holds tokens/s and the gateway's CPU."""

from __future__ import annotations

import json

import pytest

from bench.relay import main

pytestmark = pytest.mark.slow


def test_relay_benchmark_smoke_run_relays_tokens_and_writes_json(tmp_path):
    out = tmp_path / "relay.json"
    main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["processes"], r["stream_interval"]) for r in rows} == {(2, 1), (2, 4)}
    for row in rows:
        assert row["tokens_per_s"] > 0 and not row["errors"], row
        assert row["gateway_cores"] > 0 and row["tokens_per_s_per_core"] > 0
    by_interval = {r["stream_interval"]: r for r in rows}
    # Four tokens per client message: fewer messages than tokens.
    assert by_interval[4]["messages_per_s"] < by_interval[4]["tokens_per_s"] / 2
