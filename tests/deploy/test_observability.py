"""Tracing and metrics in compose: the Prometheus configuration (SchemaStore's schema) scrapes
every service's /metrics, and the collector pipeline carries OTLP spans to Jaeger."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.deploy.helpers import (
    METRICS_PORTS,
    REPO,
    SERVICES,
    compose_services,
    environment,
    load_yaml,
    prometheus_schema,
    schema_errors,
    validator_for,
)

PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
COLLECTOR = REPO / "deploy" / "otel" / "collector.yaml"


@pytest.fixture(scope="module")
def services():
    return compose_services({"REDIS_PASSWORD": "x"})


def test_prometheus_config_matches_its_schema():
    validator = validator_for(prometheus_schema())
    assert schema_errors(validator, load_yaml(PROMETHEUS)) == []
    broken = load_yaml(PROMETHEUS)
    broken["scrape_configs"][0]["scrape_intervall"] = "5s"
    assert schema_errors(validator, broken)


def test_prometheus_scrapes_every_service_on_its_metrics_port(services):
    targets = {
        target: job.get("metrics_path", "/metrics")
        for job in load_yaml(PROMETHEUS)["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    for name in SERVICES:
        assert targets.get(f"{name}:{METRICS_PORTS[name]}") == "/metrics", name
    names = set(services)
    for service in services.values():
        names |= set(service.get("networks", {}).get("default", {}).get("aliases", []))
    for target in targets:
        host = target.split(":")[0]
        assert host == "localhost" or host in names, target
    mount = f"./{PROMETHEUS.relative_to(REPO)}:/etc/prometheus/prometheus.yml:ro"
    assert mount in services["prometheus"]["volumes"]


def test_collector_pipeline_uses_only_declared_components():
    config = load_yaml(COLLECTOR)
    service = config["service"]
    assert set(service.get("extensions", [])) <= set(config.get("extensions", {}))
    for name, pipeline in service["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            declared = set(config.get(kind, {}))
            assert pipeline.get(kind) or kind == "processors", (name, kind)
            assert set(pipeline.get(kind, [])) <= declared, (name, kind)


def test_spans_flow_from_the_services_through_the_collector_to_jaeger(services):
    config = load_yaml(COLLECTOR)
    receiver = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    receiver_port = receiver.rsplit(":", 1)[1]
    assert "otlp" in config["service"]["pipelines"]["traces"]["receivers"]
    for name, service in services.items():
        env = environment(service)
        if "OTEL_EXPORTER_OTLP_ENDPOINT" not in env:
            continue
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, str(endpoint.port)) == ("otel-collector", receiver_port), name
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc", name
    exporters = config["service"]["pipelines"]["traces"]["exporters"]
    jaeger = [e for e in exporters if e.startswith("otlp/")]
    assert len(jaeger) == 1
    assert config["exporters"][jaeger[0]]["endpoint"] == "jaeger:4317"
    assert environment(services["jaeger"])["COLLECTOR_OTLP_ENABLED"] == "true"
    mounted = "/etc/otelcol-contrib/config.yaml"
    assert f"./{COLLECTOR.relative_to(REPO)}:{mounted}:ro" in services["otel-collector"]["volumes"]
    assert f"--config={mounted}" in services["otel-collector"]["healthcheck"]["test"]
