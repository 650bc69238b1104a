"""deploy/k8s: the base and each overlay, rendered by kustomize and validated against the
Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors), then the
properties the schemas cannot express."""

from __future__ import annotations

import base64
import copy
import dataclasses
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from splitserve.runtime.settings import GatewaySettings, ServiceSettings, WorkerSettings
from tests.deploy.helpers import (
    COMPOSE_FILE,
    GRPC_PORTS,
    K8S,
    KUSTOMIZATIONS,
    METRICS_PORTS,
    REPO,
    SERVICES,
    compose_services,
    containers,
    env_values,
    environment,
    kustomize_command,
    load_yaml,
    load_yaml_all,
    of_kind,
    render,
)

# The oldest Kubernetes we support (native gRPC probes are GA from 1.27) and a recent one.
K8S_VERSIONS = ("1.28", "1.33")
# Read by `splitserve` but not fields of a settings class: the log level, and where the
# secrets are (runtime/security.py: files, never flags with the secret itself).
EXTRA_SETTINGS = {
    "log_level", "api_key_file", "cluster_secret_file", "redis_password_file", "insecure",
}  # fmt: skip

needs_kustomize = pytest.mark.skipif(
    kustomize_command() is None, reason="needs kubectl (kustomize built in) or kustomize"
)


def _validate(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


# ---- files, without rendering


def test_base_resource_files_match_kubernetes_schemas():
    kustomization = load_yaml(K8S / "base" / "kustomization.yaml")
    files = kustomization["resources"]
    assert files
    for name in files:
        for doc in load_yaml_all((K8S / "base" / name).read_text()):
            for version in K8S_VERSIONS:
                _validate(doc, version)


def test_the_validator_rejects_broken_manifests():
    deployment = of_kind(load_yaml_all((K8S / "base" / "decode.yaml").read_text()), "Deployment")
    broken_type = copy.deepcopy(deployment["decode"])
    containers(broken_type)[0]["startupProbe"]["grpc"]["port"] = "grpc"
    unknown_field = copy.deepcopy(deployment["decode"])
    containers(unknown_field)[0]["readinessProbe"]["grpcc"] = {"port": 1}
    for doc in (broken_type, unknown_field):
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(doc, K8S_VERSIONS[0])


# ---- rendered


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_match_kubernetes_schemas(kustomization, version):
    docs = render(kustomization)
    assert {d["kind"] for d in docs} >= {
        "Namespace", "ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }  # fmt: skip
    for doc in docs:
        _validate(doc, version)


def _splitserve_deployments(docs) -> dict[str, dict[str, Any]]:
    deployments = of_kind(docs, "Deployment")
    assert set(deployments) == {*SERVICES, "redis"}
    return {name: deployments[name] for name in SERVICES}


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_deployment_has_startup_readiness_and_liveness_probes(kustomization):
    docs = render(kustomization)
    for name, deployment in of_kind(docs, "Deployment").items():
        for container in containers(deployment):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, (name, probe)
    for name, deployment in _splitserve_deployments(docs).items():
        (container,) = containers(deployment)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": GRPC_PORTS[name], "metrics": METRICS_PORTS[name]}
        assert env_values(container)["SPLITSERVE_PORT"] == str(ports["grpc"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": ports["grpc"], "service": ""}, name


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_services_budgets_and_autoscalers_point_at_their_deployment(kustomization):
    docs = render(kustomization)
    deployments = of_kind(docs, "Deployment")
    services = of_kind(docs, "Service")
    budgets = of_kind(docs, "PodDisruptionBudget")
    autoscalers = of_kind(docs, "HorizontalPodAutoscaler")
    assert set(services) == {*SERVICES, "redis"}
    assert set(budgets) == set(SERVICES) and set(autoscalers) == set(SERVICES)
    for name, deployment in deployments.items():
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items(), name
        assert services[name]["spec"]["selector"].items() <= pod_labels.items(), name
        port_names = {p["name"] for c in containers(deployment) for p in c["ports"]}
        for port in services[name]["spec"]["ports"]:
            assert port["targetPort"] in port_names, (name, port)
        if name in budgets:
            assert budgets[name]["spec"]["selector"]["matchLabels"] == selector, name
            assert budgets[name]["spec"]["maxUnavailable"] == 1, name
        if name in autoscalers:
            target = autoscalers[name]["spec"]["scaleTargetRef"]
            assert (target["kind"], target["name"]) == ("Deployment", name)
            assert "replicas" not in deployment["spec"], f"{name}: the HPA owns replicas"
    # Workers are found through Redis, by pod IP: their Services are headless.
    for name in ("prefill", "decode"):
        assert services[name]["spec"]["clusterIP"] == "None"


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_workers_autoscale_on_queue_depth(kustomization):
    autoscalers = of_kind(render(kustomization), "HorizontalPodAutoscaler")
    for name in ("prefill", "decode"):
        spec = autoscalers[name]["spec"]
        assert spec["minReplicas"] >= 1 and spec["maxReplicas"] >= spec["minReplicas"]
        (metric,) = spec["metrics"]
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] == "splitserve_num_requests_waiting"
        assert metric["pods"]["target"]["type"] == "AverageValue"


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_pods_advertise_their_ip_and_are_scraped_on_their_metrics_port(kustomization):
    for name, deployment in _splitserve_deployments(render(kustomization)).items():
        template = deployment["spec"]["template"]
        (container,) = containers(deployment)
        env = env_values(container)
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["SPLITSERVE_ADVERTISE_HOST"] == "$(POD_IP)"
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(METRICS_PORTS[name]),
            "prometheus.io/path": "/metrics",
        }
        assert env["SPLITSERVE_METRICS_PORT"] == str(METRICS_PORTS[name])
        assert env["OTEL_SERVICE_NAME"] == f"splitserve-{name}"
        # NOTE: with service links on, a Service named e.g. splitserve-metrics would inject
        # SPLITSERVE_METRICS_PORT=tcp://…, which the settings would read.
        assert template["spec"]["enableServiceLinks"] is False
        # SIGTERM drains for up to SPLITSERVE_DRAIN_TIMEOUT_S; the kubelet must wait longer.
        drain_s = float(env["SPLITSERVE_DRAIN_TIMEOUT_S"])
        assert drain_s >= 30 and template["spec"]["terminationGracePeriodSeconds"] >= drain_s + 10


def _config_keys(docs) -> dict[str, str]:
    (config,) = of_kind(docs, "ConfigMap").values()
    return dict(config["data"])


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_env_references_resolve(kustomization):
    """Kubernetes leaves an undefined $(VAR) as it is, silently: each must be defined first."""
    docs = render(kustomization)
    configs, secrets = of_kind(docs, "ConfigMap"), of_kind(docs, "Secret")
    for name, deployment in of_kind(docs, "Deployment").items():
        for container in containers(deployment):
            defined = set()
            for source in container.get("envFrom", []):
                defined |= set(configs[source["configMapRef"]["name"]]["data"])
            texts = list(container.get("args", []))
            for item in container.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", item.get("value", "")):
                    assert ref in defined, (name, item["name"], ref)
                secret = item.get("valueFrom", {}).get("secretKeyRef")
                if secret:
                    assert secret["key"] in secrets[secret["name"]]["data"], (name, secret)
                defined.add(item["name"])
            for text in texts:
                for ref in re.findall(r"\$\((\w+)\)", text):
                    assert ref in defined, (name, "args", ref)


def _known_settings() -> set[str]:
    fields = {
        f.name
        for cls in (ServiceSettings, WorkerSettings, GatewaySettings)
        for f in dataclasses.fields(cls)
    }
    return fields | EXTRA_SETTINGS


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_splitserve_variable_names_a_setting(kustomization):
    docs = render(kustomization)
    names = set(_config_keys(docs))
    for deployment in _splitserve_deployments(docs).values():
        names |= set(env_values(containers(deployment)[0]))
    settings = {n.removeprefix("SPLITSERVE_").lower() for n in names if n[:11] == "SPLITSERVE_"}
    assert settings and settings <= _known_settings(), settings - _known_settings()


def test_every_splitserve_variable_in_compose_names_a_setting():
    names = set()
    for service in compose_services({"REDIS_PASSWORD": "x"}).values():
        names |= {n for n in environment(service) if n.startswith("SPLITSERVE_")}
    settings = {n.removeprefix("SPLITSERVE_").lower() for n in names}
    assert settings and settings <= _known_settings(), settings - _known_settings()


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_redis_password_lives_only_in_the_secret(kustomization):
    docs = render(kustomization)
    (secret,) = [s for n, s in of_kind(docs, "Secret").items() if n.startswith("redis-auth")]
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 16
    encoded = secret["data"]["password"]
    for doc in docs:
        if doc is secret:
            continue
        text = yaml.safe_dump(doc)
        assert password not in text and encoded not in text, doc["metadata"]["name"]
    # Every consumer takes it from the Secret and builds its URL with $(REDIS_PASSWORD).
    for name, deployment in of_kind(docs, "Deployment").items():
        env = env_values(containers(deployment)[0])
        ref = env["REDIS_PASSWORD"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "password"}, name
        if name in SERVICES:
            assert env["SPLITSERVE_REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@redis:6379/0"
    # Redis reads it as configuration on stdin, from the shell's environment: not in argv.
    redis_container = containers(of_kind(docs, "Deployment")["redis"])[0]
    assert "args" not in redis_container
    command = redis_container["command"]
    assert command[:2] == ["sh", "-c"] and "$(" not in " ".join(command)
    assert "redis-server - " in command[2] and 'requirepass "$REDIS_PASSWORD"' in command[2]
    # …and in the repository only the Secret's source holds it.
    holders = [
        path.relative_to(REPO).as_posix()
        for path in [*(REPO / "deploy").rglob("*"), COMPOSE_FILE, REPO / "docs" / "deploy.md"]
        if path.is_file() and password in path.read_text()
    ]
    assert holders == ["deploy/k8s/base/redis-auth.env"]


@needs_kustomize
def test_gpu_overlay_gives_prefill_and_decode_a_gpu_each_on_gpu_nodes():
    docs = render("overlays/gpu")
    deployments = _splitserve_deployments(docs)
    (claim,) = of_kind(docs, "PersistentVolumeClaim").values()
    model = _config_keys(docs)["SPLITSERVE_MODEL"]
    for name in ("prefill", "decode"):
        spec = deployments[name]["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        resources = container["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) >= 1, name
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
    for name, deployment in deployments.items():
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"]["mountPath"] == model and mounts["model"]["readOnly"], name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert container["image"] == "splitserve:cuda", name
    assert "nvidia.com/gpu" not in str(deployments["gateway"])


@needs_kustomize
def test_cpu_tiny_overlay_runs_the_default_model_on_cpus():
    docs = render("overlays/cpu-tiny")
    config = _config_keys(docs)
    assert "SPLITSERVE_MODEL" not in config  # the tiny model baked into the image
    assert config["SPLITSERVE_DEVICE"] == "cpu" and config["SPLITSERVE_DTYPE"] == "float32"
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    for name, deployment in _splitserve_deployments(docs).items():
        (container,) = containers(deployment)
        assert container["image"] == "splitserve:cpu", name
        assert "persistentVolumeClaim" not in str(deployment), name
    for autoscaler in of_kind(docs, "HorizontalPodAutoscaler").values():
        assert autoscaler["spec"]["maxReplicas"] <= 2


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_pods_run_unprivileged_on_a_read_only_root(kustomization):
    for name, deployment in of_kind(render(kustomization), "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"] == {"drop": ["ALL"]}, name


@needs_kustomize
def test_overlays_share_the_base_settings_and_change_only_what_they_must():
    base = _config_keys(render("base"))
    for overlay in ("overlays/cpu-tiny", "overlays/gpu"):
        config = _config_keys(render(overlay))
        assert config["SPLITSERVE_BLOCK_SIZE"] == base["SPLITSERVE_BLOCK_SIZE"]
        assert config.keys() >= base.keys(), overlay


@needs_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_secrets_are_mounted_files_and_only_members_reach_the_workers(kustomization):
    docs = render(kustomization)
    (auth,) = [s for n, s in of_kind(docs, "Secret").items() if n.startswith("splitserve-auth")]
    assert set(auth["data"]) == {"cluster-secret", "api-keys"}
    for name, deployment in _splitserve_deployments(docs).items():
        (container,) = containers(deployment)
        env = env_values(container)
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["splitserve-auth"]["readOnly"], name
        directory = mounts["splitserve-auth"]["mountPath"]
        volume = next(
            v for v in deployment["spec"]["template"]["spec"]["volumes"]
            if v["name"] == "splitserve-auth"
        )  # fmt: skip
        assert volume["secret"]["secretName"] == auth["metadata"]["name"], name
        files = {item["key"] for item in volume["secret"]["items"]}
        assert env["SPLITSERVE_CLUSTER_SECRET_FILE"] == f"{directory}/cluster-secret", name
        if name == "gateway":
            assert env["SPLITSERVE_API_KEY_FILE"] == f"{directory}/api-keys"
            assert files == {"cluster-secret", "api-keys"}
        else:
            assert files == {"cluster-secret"}, name  # the API keys stay with the gateway
        secret_values = [base64.b64decode(v).decode().strip() for v in auth["data"].values()]
        assert not [v for v in secret_values if v in yaml.safe_dump(deployment)], name
    policies = of_kind(docs, "NetworkPolicy")
    members = {"gateway", "prefill", "decode"}
    for name, components in (("workers", {"prefill", "decode"}), ("redis", {"redis"})):
        spec = policies[name]["spec"]
        selected = spec["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
        expressions = spec["podSelector"].get("matchExpressions", [])
        assert ({selected} if selected else set(expressions[0]["values"])) == components, name
        for rule in spec["ingress"]:
            if "from" in rule:
                (source,) = rule["from"]
                assert set(source["podSelector"]["matchExpressions"][0]["values"]) == members
            else:  # open to anyone: only the metrics port of a worker
                assert name == "workers" and rule["ports"] == [{"port": "metrics"}], rule
