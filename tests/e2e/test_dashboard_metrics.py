"""Every metric the Grafana dashboard and the alert rules read is in the live /metrics of the
service they ask it of: a stack with the tiny model serves a few requests, then the gateway, the
prefill and the decode worker are scraped as Prometheus would scrape them.

A metric counts as exported when its family is in the scrape (`# TYPE` line): a labelled
counter such as `splitserve:worker_suspicions` has no sample until its first event, yet
Prometheus and Grafana query it by the same name once it has one."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.deploy.dashboard import (
    PROMETHEUS_SERIES,
    dashboard_expressions,
    family_series,
    rule_expressions,
    selectors,
)
from tests.e2e.harness import gateway, running_stack

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def exported(port: int) -> set[str]:
    """The sample names of every family in one scrape of a service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        name
        for family in text_string_to_metric_families(text)
        for name in family_series(family.name, family.type)
    }


def test_every_metric_of_the_dashboard_and_the_alerts_is_exported(tiny_models):
    with running_stack(tiny_models["llama"], prefill=1, decode=1, metrics=True) as stack:
        stub = gateway(stack)
        for prompt in ("the dashboard reads", "what the services export"):
            assert len(collect(stream(stub, prompt, PARAMS, timeout_s=60)).token_ids[0]) == 6
        roles = {"gateway": "gateway", "prefill-0": "prefill", "decode-0": "decode"}
        assert set(stack.metrics_ports) == set(roles)
        by_role = {roles[name]: exported(port) for name, port in stack.metrics_ports.items()}

    missing = []
    expressions = [*dashboard_expressions(), *rule_expressions().values()]
    for expr in expressions:
        for s in selectors(expr):
            if s.metric in PROMETHEUS_SERIES:
                continue
            if s.component is None:
                wanted = set(by_role)
            elif s.component_is_regex:
                wanted = set(s.component.split("|"))
            else:
                wanted = {s.component}
            # A selector for one role must find the metric there; one for any role, somewhere.
            found = [role for role in wanted if s.metric in by_role[role]]
            if not found or (s.component is not None and set(found) != wanted):
                missing.append((s.metric, s.component, sorted(found)))
    assert not missing, missing
    assert len(expressions) > 20
