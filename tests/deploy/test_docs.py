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


def _mentioned_paths(text: str) -> set[str]:
    """Repository paths in backticks or links: anything with a slash or a known file suffix."""
    found = set(re.findall(r"`([\w.\-]+(?:/[\w.\-*]*)+)`", text))
    found |= set(re.findall(r"\]\(((?!https?:)[^)#\s]+)\)", text))
    found |= set(re.findall(r"`([\w\-]+\.(?:md|py|sh|toml|yaml|proto))`", text))
    return {p.rstrip("/") for p in found if not p.startswith(("http", "/", "~", "$"))}


def test_every_path_the_readme_mentions_exists_in_the_repository():
    text = (REPO / "README.md").read_text()
    paths = _mentioned_paths(text)
    assert "docs/design.md" in paths and "bench/device.sh" in paths
    for path in sorted(paths):
        if "*" in path:
            assert list(REPO.glob(path)), path
        else:
            assert (REPO / path).exists(), path
        assert not path.startswith(".."), path  # nothing outside the repository


def test_docs_readme_and_bench_speak_of_the_project_only():
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "bench").glob("*")]
    words = re.compile(r"\bsessions?\s+\d|\bsession\s+(?:one|two)|`device`\s+tool|\blent\b", re.I)
    for path in files:
        if path.is_file():
            hits = words.findall(path.read_text())
            assert not hits, (path.name, hits)
