"""Shared by the deployment tests: the repository's deployment files, loaded and rendered.

Schemas come from installed packages (`check-jsonschema` for the Compose specification,
`kubernetes-validate` for Kubernetes) or from `schemas/` (Prometheus, Grafana: see its README);
Kubernetes overlays are rendered by kustomize (`kubectl kustomize`, or a standalone
`kustomize`). Nothing here touches the network.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import tomllib
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
DOCKERFILE = REPO / "Dockerfile"
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu-tiny", "overlays/gpu")
SCHEMAS = Path(__file__).resolve().parent / "schemas"

# The services of splitserve, their gRPC and Prometheus ports inside a container or pod.
SERVICES = ("gateway", "prefill", "decode")
GRPC_PORTS = {"gateway": 50051, "prefill": 50061, "decode": 50071}
METRICS_PORTS = {"gateway": 9100, "prefill": 9101, "decode": 9102}


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def validator_for(schema: Mapping[str, Any]) -> jsonschema.protocols.Validator:
    """A validator of the schema's own draft, after checking the schema itself."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(validator: jsonschema.protocols.Validator, instance: Any) -> list[str]:
    return [
        f"{'/'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    ]


@cache
def compose_spec_schema() -> dict[str, Any]:
    """The Compose specification's JSON schema, as check-jsonschema vendors it."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


@cache
def prometheus_schema() -> dict[str, Any]:
    return json.loads((SCHEMAS / "prometheus.json").read_text())


# ---- Compose variable interpolation (https://docs.docker.com/compose/how-tos/environment-
# variables/variable-interpolation/): $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e},
# ${VAR?e}, ${VAR:+r}, ${VAR+r}.
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})"
)


class MissingVariable(KeyError):
    """A `${VAR:?message}` whose variable is unset (or empty)."""


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Substitute variables in every string value, as `docker compose config` does."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["named"] or match["braced"]
        op, arg = match["op"], match["arg"] or ""
        is_set = name in env
        is_nonempty = bool(env.get(name))
        present = is_nonempty if op and op.startswith(":") else is_set
        if op in ("-", ":-"):
            return env[name] if present else arg
        if op in ("?", ":?"):
            if not present:
                raise MissingVariable(f"{name}: {arg}")
            return env[name]
        if op in ("+", ":+"):
            return arg if present else ""
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


def compose_services(env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    doc = load_yaml(COMPOSE_FILE)
    if env is not None:
        doc = interpolate(doc, env)
    return doc["services"]


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A compose service's `environment`, as a mapping, whichever syntax it uses."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


# ---- Kubernetes


def kustomize_command() -> list[str] | None:
    """How to run `kustomize build` here: kubectl's built-in kustomize, or a standalone one."""
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


@cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    """The manifests a kustomization renders to (kustomize fails on unknown fields in
    kustomization.yaml, so this also validates those files)."""
    command = kustomize_command()
    assert command is not None, "no kustomize here"
    out = subprocess.run(
        [*command, str(K8S / kustomization)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return tuple(load_yaml_all(out.stdout))


def of_kind(docs: tuple[dict[str, Any], ...] | list[dict[str, Any]], kind: str) -> dict:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def containers(deployment: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def env_values(container: Mapping[str, Any]) -> dict[str, Any]:
    """name -> value, or name -> the valueFrom mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# ---- the probe that compose and the Dockerfile run


def normalized(code: str) -> str:
    return " ".join(code.split())


# ---- the Dockerfile, parsed by BuildKit's own parser (the `dockerfile` package)


@cache
def dockerfile_commands() -> tuple[Any, ...]:
    import dockerfile

    return tuple(dockerfile.parse_file(str(DOCKERFILE)))


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults."""
    args = {}
    for command in dockerfile_commands():
        if command.cmd == "FROM":
            break
        if command.cmd == "ARG":
            name, _, default = command.value[0].partition("=")
            args[name] = default
    return args


def stages() -> list[list[Any]]:
    """The instructions of each build stage, FROM first."""
    result: list[list[Any]] = []
    for command in dockerfile_commands():
        if command.cmd == "FROM":
            result.append([])
        if result:
            result[-1].append(command)
    return result


def runtime_env() -> dict[str, str]:
    """ENV of the final stage and of the stage it is built FROM, as the container sees it."""
    by_name = {stage[0].value[-1]: stage for stage in stages() if len(stage[0].value) == 3}
    chain, stage = [], stages()[-1]
    while stage is not None:
        chain.append(stage)
        stage = by_name.get(stage[0].value[0])
    env: dict[str, str] = {}
    for stage in reversed(chain):
        for command in stage:
            if command.cmd == "ENV":
                values = command.value
                env.update(zip(values[::2], values[1::2], strict=True))
    return env
