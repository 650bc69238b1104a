"""`bench/serving.py --phased` runs end to end on the CPU: one stack of role-switch workers takes
each split in turn and the planner's run, every request completes, and the JSON holds goodput
under the three SLOs, per phase, and the split over time."""

from __future__ import annotations

import json

import pytest

from bench.serving import main

pytestmark = pytest.mark.slow


def test_phased_smoke_runs_static_splits_and_the_planner_and_reports_the_split_over_time(
    tmp_path,
):
    out = tmp_path / "phased.json"
    main(["--smoke", "--phased", "--split-configs", "4 colocated", "1P+3D", "planner",
          "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    runs = {r["config"]: r for r in result["results"]}
    assert set(runs) == {"4 colocated", "1P+3D", "planner"}
    for run in runs.values():
        assert run["ok"] == run["requests"] > 0 and not run["errors"]
        assert set(run["goodput"]) == {"relaxed", "interactive", "smooth"}
        assert len(run["phases"]) == 3
    assert runs["4 colocated"]["split_series"][0]["colocated"] == 4
    first = runs["1P+3D"]["split_series"][0]
    assert (first["prefill"], first["decode"], first["colocated"]) == (1, 3, 0)
    assert runs["planner"]["split_series"][0]["prefill"] == 2
    # every gateway process's /metrics feeds the planner (none read: it can never move)
    assert runs["planner"]["planner_metrics_pages"] >= 1
    assert result["verdict"]
