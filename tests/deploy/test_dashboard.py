"""The Grafana dashboard and the Prometheus alert rules, checked offline: the dashboard against
the JSON schemas Grafana publishes, every expression parsed as PromQL, every metric one that
splitserve defines (tests/e2e/test_dashboard_metrics.py checks the same against live services),
and compose wiring Grafana to the Prometheus that loads the rules."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess

import promql_parser
import pytest

from splitserve.runtime.engine_metrics import EngineCollector
from splitserve.runtime.metrics import (
    REQUEST_HISTOGRAMS,
    KVTransferMetrics,
    Metrics,
    RequestMetrics,
    RoutingMetrics,
)
from tests.deploy.dashboard import (
    ALERTS,
    DASHBOARD,
    PROMETHEUS_SERIES,
    alert_rules,
    dashboard,
    dashboard_expressions,
    family_series,
    grafana_schema,
    mounts,
    panel_targets,
    parse,
    provisioning,
    rule_expressions,
    selectors,
)
from tests.deploy.helpers import REPO, compose_services, load_yaml, schema_errors, validator_for

PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"


@pytest.fixture(scope="module")
def services():
    return compose_services({"REDIS_PASSWORD": "x"})


def defined_series() -> set[str]:
    """Every sample name a splitserve service can export, from the code that defines them."""
    metrics = Metrics("m")
    RequestMetrics(metrics, REQUEST_HISTOGRAMS, outcomes=True)
    KVTransferMetrics(metrics)
    RoutingMetrics(metrics)
    families = [*metrics.registry.collect(), *EngineCollector(lambda _: None, "m").describe()]
    return {name for f in families for name in family_series(f.name, f.type)}


def test_the_dashboard_matches_grafanas_dashboard_schema():
    validator = validator_for(grafana_schema("dashboard"))
    assert schema_errors(validator, dashboard()) == []
    broken = copy.deepcopy(dashboard())
    broken["panels"][0]["titel"] = "typo"
    del broken["templating"]
    errors = schema_errors(validator, broken)
    assert any("titel" in e for e in errors) and any("templating" in e for e in errors), errors


def test_every_panels_options_match_its_panel_plugins_schema():
    for kind in {panel["type"] for panel in dashboard()["panels"]}:
        # Grafana publishes each panel plugin's options (and custom field config) as a schema.
        schema = grafana_schema(kind)
        options = validator_for({**schema, "$ref": "#/definitions/Options"})
        custom = validator_for({**schema, "$ref": "#/definitions/FieldConfig"})
        for panel in (p for p in dashboard()["panels"] if p["type"] == kind):
            assert schema_errors(options, panel["options"]) == [], panel["title"]
            field_config = panel["fieldConfig"]["defaults"].get("custom", {})
            if "FieldConfig" in schema["definitions"]:
                assert schema_errors(custom, field_config) == [], panel["title"]
    stat = validator_for({**grafana_schema("stat"), "$ref": "#/definitions/Options"})
    assert schema_errors(stat, {"graphMode": "sparkle"})


def test_every_query_matches_grafanas_prometheus_query_schema():
    validator = validator_for(grafana_schema("prometheus-query"))
    ref_ids: dict[int, list[str]] = {}
    for panel, target in panel_targets():
        assert schema_errors(validator, target) == [], (panel["title"], target)
        assert (
            target["datasource"]
            == panel["datasource"]
            == {
                "type": "prometheus",
                "uid": "${datasource}",
            }
        )
        ref_ids.setdefault(panel["id"], []).append(target["refId"])
    assert all(len(ids) == len(set(ids)) for ids in ref_ids.values()), ref_ids
    assert schema_errors(validator, {"expr": "up", "format": "graph"})


def test_panels_have_unique_ids_and_do_not_overlap():
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine


def test_every_expression_is_promql():
    for expr in [*dashboard_expressions(), *rule_expressions().values()]:
        parse(expr)
    with pytest.raises(ValueError, match="parenthesis"):
        parse("sum(rate(splitserve:num_steps_total[$__rate_interval])")
    with pytest.raises(ValueError, match="expected type matrix"):  # types are checked too
        parse("rate(splitserve:num_steps_total)")


def test_every_metric_they_read_is_one_splitserve_defines():
    defined = defined_series()
    assert "splitserve:time_to_first_token_seconds_bucket" in defined
    assert "splitserve:kv_cache_usage_perc" in defined
    for expr in [*dashboard_expressions(), *rule_expressions().values()]:
        for selector in selectors(expr):
            assert selector.metric in defined | PROMETHEUS_SERIES, (selector.metric, expr)


def test_the_panels_cover_what_an_operator_asks_first():
    used = {s.metric for expr in dashboard_expressions() for s in selectors(expr)}
    latency = ("time_to_first_token", "inter_token_latency", "e2e_request_latency")
    for name in (
        *(f"splitserve:{h}_seconds_bucket" for h in latency),
        "splitserve:kv_transfer_seconds_bucket",
        "splitserve:request_success_total",
        "splitserve:num_prefill_tokens_total",
        "splitserve:num_requests_running",
        "splitserve:num_requests_waiting",
        "splitserve:kv_cache_usage_perc",
        "splitserve:prefix_cache_hits_total",
        "splitserve:kv_transfer_bytes_total",
        "splitserve:num_preemptions_total",
        "splitserve:kv_transfer_failures_total",
        "up",
    ):
        assert name in used, name
    percentiles = [t["expr"] for _, t in panel_targets() if "histogram_quantile" in t["expr"]]
    assert len(percentiles) >= 12


def test_components_it_selects_are_the_scrape_jobs_labels():
    labels = {
        static["labels"]["component"]
        for job in load_yaml(PROMETHEUS_YML)["scrape_configs"]
        for static in job.get("static_configs", [])
        if "component" in static.get("labels", {})
    }
    assert labels == {"gateway", "prefill", "decode"}
    for expr in [*dashboard_expressions(), *rule_expressions().values()]:
        for s in selectors(expr):
            if s.component is not None:
                wanted = set(s.component.split("|")) if s.component_is_regex else {s.component}
                assert wanted <= labels, (s, expr)


def test_alert_rules_are_well_formed():
    groups = alert_rules()["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    rules = [rule for group in groups for rule in group["rules"]]
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names)
    assert {
        "SplitserveDecodeWorkerDown",
        "SplitserveNoPrefillWorkers",
        "SplitserveTTFTHigh",
        "SplitserveKVCacheNearlyFull",
        "SplitserveRequestsFailing",
    } <= set(names)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert promql_parser.parse_duration(rule["for"]).total_seconds() > 0, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        parse(rule["expr"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules():
    result = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_expressions())} rules found" in result.stdout


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_alerts_fire_on_a_sick_stack_and_not_on_a_healthy_one():
    tests = ALERTS.with_name("alerts.test.yml")
    assert load_yaml(tests)["rule_files"] == [ALERTS.name]
    result = subprocess.run(
        ["promtool", "test", "rules", tests.name],
        cwd=tests.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_loads_the_rules_compose_mounts(services):
    rule_files = load_yaml(PROMETHEUS_YML)["rule_files"]
    mounted = mounts(services["prometheus"])
    assert [mounted[path] for path in rule_files] == [ALERTS]


def test_compose_grafana_reads_the_compose_prometheus_and_serves_the_dashboard(services):
    grafana = services["grafana"]
    assert "profiles" not in grafana
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    mounted = mounts(grafana)
    for target, source in mounted.items():
        assert source.is_file(), (target, source)
    folder = "/etc/grafana/provisioning"
    assert mounted[f"{folder}/datasources/prometheus.yaml"] == (
        REPO / "deploy/grafana/provisioning/datasources/prometheus.yaml"
    )
    (source,) = provisioning("datasources/prometheus.yaml")["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    prometheus_port = services["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    scrape = load_yaml(PROMETHEUS_YML)["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape

    provider_file = f"{folder}/dashboards/splitserve.yaml"
    assert mounted[provider_file] == REPO / "deploy/grafana/provisioning/dashboards/splitserve.yaml"
    (provider,) = provisioning("dashboards/splitserve.yaml")["providers"]
    dashboards = {
        t: s for t, s in mounted.items() if t.startswith(provider["options"]["path"] + "/")
    }
    assert list(dashboards.values()) == [DASHBOARD]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in dashboards
    assert "GF_SECURITY_ADMIN_PASSWORD" in grafana["environment"]


def test_the_docs_list_every_alert_and_say_where_the_dashboard_is():
    doc = (REPO / "docs" / "deploy.md").read_text()
    table = set(re.findall(r"^\| `(Splitserve\w+)` \|", doc, flags=re.M))
    assert table == set(rule_expressions())
    assert f"`{DASHBOARD.relative_to(REPO)}`" in doc and f"`{ALERTS.relative_to(REPO)}`" in doc
    assert "http://localhost:3000" in doc and dashboard()["uid"] in doc
