"""docs/deploy.md names only profiles, services, paths and ports that exist."""

from __future__ import annotations

import re

from tests.deploy.helpers import (
    GRPC_PORTS,
    K8S,
    KUSTOMIZATIONS,
    METRICS_PORTS,
    REPO,
    SERVICES,
    compose_services,
)

DOC = (REPO / "docs" / "deploy.md").read_text()


def test_it_has_the_compose_and_kubernetes_sections():
    headings = re.findall(r"^## (.+)$", DOC, flags=re.M)
    assert "Running with compose" in headings
    assert "Deploying to Kubernetes" in headings


def test_compose_commands_name_existing_profiles_and_services():
    services = compose_services({"REDIS_PASSWORD": "x"})
    profiles = {p for service in services.values() for p in service.get("profiles", [])}
    used = set(re.findall(r"docker compose --profile (\w+)", DOC))
    assert used == profiles == {"cpu", "gpu"}
    for name in re.findall(r"docker compose exec ([\w-]+)", DOC):
        assert name in services, name


def test_kubectl_commands_name_existing_kustomizations():
    paths = re.findall(r"kubectl (?:apply -k|kustomize) (\S+)", DOC)
    assert {"deploy/k8s/overlays/cpu-tiny", "deploy/k8s/overlays/gpu"} <= set(paths)
    for path in paths:
        assert (REPO / path / "kustomization.yaml").is_file(), path
        assert (REPO / path).relative_to(K8S).as_posix() in KUSTOMIZATIONS


def test_every_deploy_path_it_names_exists():
    for path in set(re.findall(r"`((?:deploy|tests)/[\w./-]+)`", DOC)):
        assert (REPO / path).exists(), path


def test_its_port_table_is_the_one_the_files_use():
    for name in SERVICES:
        row = re.search(rf"^\| {name} \| (\d+)[^|]*\| (\d+) \|", DOC, flags=re.M)
        assert row, name
        assert (int(row[1]), int(row[2])) == (GRPC_PORTS[name], METRICS_PORTS[name])
