"""bench/lease_renewals.py times both ways over real records, loses none and cleans up."""

from __future__ import annotations

import json

from bench import lease_renewals


def test_both_ways_run_at_each_size_and_write_json(tmp_path):
    out = tmp_path / "leases.json"
    results = lease_renewals.main(["--leases", "3", "7", "--rounds", "2", "--out", str(out)])
    assert [(r["leases"], r["way"]) for r in results["rows"]] == [
        (3, "one call each"), (3, "renew_many"), (7, "one call each"), (7, "renew_many"),
    ]  # fmt: skip
    assert all(r["wall_ms"] > 0 and r["cpu_ms"] >= 0 for r in results["rows"])
    assert json.loads(out.read_text())["rows"] == results["rows"]
