"""The Grafana dashboard and the Prometheus alert rules, read as the tests need them: every PromQL
expression they hold, and the metric names and `component` matchers in each.

Expressions are parsed by `promql-parser` (a binding of the Rust parser that follows
Prometheus's grammar), not by regular expressions: a name inside a label value, a function or
an aggregation is never taken for a metric. Grafana's variables are replaced first by values
Prometheus itself would accept, since Grafana substitutes them before it sends a query.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import promql_parser

from tests.deploy.helpers import REPO, SCHEMAS, load_yaml

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "splitserve.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
GRAFANA = REPO / "deploy" / "grafana"

# What Grafana puts in place of the dashboard's variables before a query leaves it.
VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}

# Series Prometheus makes itself for every scrape target, not the services.
PROMETHEUS_SERIES = frozenset({"up"})


@dataclass(frozen=True)
class Selector:
    """One series selector of an expression: its metric name and the `component` it asks for
    (None: any; a regex such as "prefill|decode" is kept as written)."""

    metric: str
    component: str | None
    component_is_regex: bool


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@cache
def alert_rules() -> dict[str, Any]:
    return load_yaml(ALERTS)


@cache
def grafana_schema(name: str) -> dict[str, Any]:
    """A schema Grafana publishes (grafana-foundation-sdk's jsonschema/, see schemas/README)."""
    return json.loads((SCHEMAS / f"grafana-{name}.json").read_text())


def panel_targets() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of every panel."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def dashboard_expressions() -> list[str]:
    """Every PromQL the dashboard sends: panel queries and the variables' `label_values`
    metrics (as a bare selector), as written (variables not replaced)."""
    exprs = [target["expr"] for _, target in panel_targets()]
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query" and isinstance(query, str):
            assert query.startswith("label_values(") and query.endswith(")"), query
            metric, _, _label = query[len("label_values(") : -1].rpartition(",")
            exprs.append(metric.strip())
    return exprs


def rule_expressions() -> dict[str, str]:
    """Alert (or record) name -> its expression."""
    return {
        rule.get("alert") or rule["record"]: rule["expr"]
        for group in alert_rules()["groups"]
        for rule in group["rules"]
    }


def parse(expr: str) -> promql_parser.Expr:
    """The expression's syntax tree, after Grafana's variables are replaced (ValueError when it
    is not PromQL)."""
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"an unknown variable in {expr!r}"
    return promql_parser.parse(expr)


def selectors(expr: str) -> list[Selector]:
    """The series selectors of an expression, in the order they appear."""
    found: list[Selector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            component, regex = None, False
            for matcher in node.matchers.matchers:
                if matcher.name == "component":
                    assert matcher.op in (promql_parser.MatchOp.Equal, promql_parser.MatchOp.Re)
                    component, regex = matcher.value, matcher.op == promql_parser.MatchOp.Re
            assert node.name, f"a selector without a metric name in {expr!r}"
            found.append(Selector(node.name, component, regex))

    promql_parser.walk(parse(expr), visit)
    return found


def family_series(name: str, kind: str) -> set[str]:
    """The sample names a metric family of this type puts in an exposition."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_count", "_sum"),
        "summary": ("", "_count", "_sum"),
    }.get(kind, ("",))
    return {name + suffix for suffix in suffixes}


def provisioning(path: str) -> dict[str, Any]:
    return load_yaml(GRAFANA / "provisioning" / path)


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A compose service's bind mounts: target -> source (a path in the repository)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        out[target] = REPO / source
    return out
