"""The KV transfer benchmark (bench/kv_transfer.py) runs end to end on the CPU: a prefill engine
here and a decode engine in a spawned process, over real NIXL (UCX) and real gRPC."""

from __future__ import annotations

import json

import pytest

from bench.kv_transfer import main

pytestmark = pytest.mark.slow

TRANSPORTS = ("nixl", "grpc")
TOKENS = (40, 130)


def test_kv_transfer_benchmark_smoke_run_writes_json(tmp_path):
    out = tmp_path / "kv_transfer.json"
    main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())

    assert result["devices"] == {"prefill": "cpu", "decode": "cpu"}
    assert result["dtype"] == "float32" and result["ceilings_GB_per_s"]["host memcpy"] > 0
    rows = {(r["transport"], r["tokens"]): r for r in result["rows"]}
    assert set(rows) == {(t, n) for t in TRANSPORTS for n in TOKENS}
    for key, row in rows.items():
        assert "skipped" not in row, f"{key}: {row.get('skipped')}"
        assert row["bytes"] == row["num_blocks"] * result["block_bytes"]
        assert row["num_blocks"] == -(-row["tokens"] // result["block_size"])
        assert row["GB/s"] > 0 and row["transfer ms"] > 0 and row["% of ceil"] > 0
        # D admitted every request it was sent, and what landed is what P computed.
        assert row["admitted"] == row["requests"] == result["repeats"] + 1
        assert row["pipelined_admitted"] == row["pipelined_requests"] == result["repeats"]
        assert row["checksum_ok"] is True, key
        assert row["prefill ms"] > 0 and row["exposed ms"] > 0 and row["ratio"] > 0
        # one push per chunk of the prompt (the last chunk's blocks may come in one batch)
        assert all(len(pushes) >= 2 for pushes in row["pushes"])
    for transport in TRANSPORTS:
        assert rows[(transport, TOKENS[0])]["first push ms"] > 0
    # Nothing stays pinned, reserved or running on either side.
    stats = result["engine_stats_after"]
    assert stats["prefill"]["num_pinned_blocks"] == stats["prefill"]["num_requests"] == 0
    assert stats["decode"]["num_requests"] == stats["decode"]["num_reservations"] == 0
    for side in ("prefill", "decode"):
        assert stats[side]["num_free_blocks"] == stats[side]["num_total_blocks"]
