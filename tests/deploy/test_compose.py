"""compose.yaml: valid Compose, healthy start-up order, GPUs, and the same commands as the
end-to-end tests."""

from __future__ import annotations

import copy
import re
import socket
import subprocess
import sys
from typing import Any

import pytest

from splitserve.launch import up
from splitserve.launch.default_model import tiny_model_dir
from tests.deploy.helpers import (
    COMPOSE_FILE,
    GRPC_PORTS,
    METRICS_PORTS,
    REPO,
    SERVICES,
    MissingVariable,
    compose_services,
    compose_spec_schema,
    environment,
    interpolate,
    load_yaml,
    runtime_env,
    schema_errors,
    validator_for,
)
from tests.e2e.harness import WORKER_ARGS

PASSWORD = "compose-test-password"
ENV = {"REDIS_PASSWORD": PASSWORD}
CPU = {name: f"{name}-cpu" for name in SERVICES}  # splitserve service -> compose service
GPU = {name: name for name in SERVICES}
INFRA = ("redis", "otel-collector", "jaeger", "prometheus", "grafana")


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return compose_services(ENV)


def test_compose_file_matches_the_compose_specification():
    validator = validator_for(compose_spec_schema())
    assert schema_errors(validator, load_yaml(COMPOSE_FILE)) == []


def test_the_compose_schema_rejects_what_compose_would_reject():
    validator = validator_for(compose_spec_schema())
    doc = load_yaml(COMPOSE_FILE)
    typo = copy.deepcopy(doc)
    typo["services"]["redis"]["healthcheck"]["intervall"] = "5s"
    wrong_type = copy.deepcopy(doc)
    wrong_type["services"]["decode"]["deploy"]["resources"]["reservations"]["devices"] = "all"
    assert schema_errors(validator, typo)
    assert schema_errors(validator, wrong_type)


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return [value] if isinstance(value, str) else []


def test_the_redis_password_must_be_given_and_has_no_default():
    uses = [
        use
        for text in _strings(load_yaml(COMPOSE_FILE))
        for use in re.findall(r"\$\{?REDIS_PASSWORD(?::?[-?+])?", text)
    ]
    assert uses and all(use == "${REDIS_PASSWORD:?" for use in uses), uses
    with pytest.raises(MissingVariable):
        compose_services({})


def test_every_service_has_a_healthcheck(services):
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check and not check.get("disable"), name
        assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, name


def test_depends_on_waits_for_healthy_services_of_the_same_profile(services):
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: use the long depends_on syntax"
        for target, how in depends.items():
            assert how == {"condition": "service_healthy"}, (name, target)
            assert "healthcheck" in services[target], (name, target)
            target_profiles = set(services[target].get("profiles", []))
            assert not target_profiles or target_profiles == set(service.get("profiles", [])), (
                f"{name} depends on {target}, which its profile does not start"
            )
    for profile in (CPU, GPU):
        assert set(services[profile["gateway"]]["depends_on"]) == {
            "redis",
            "otel-collector",
            profile["prefill"],
            profile["decode"],
        }
        for worker in ("prefill", "decode"):
            assert set(services[profile[worker]]["depends_on"]) == {"redis", "otel-collector"}


def test_profiles_split_cpu_from_gpu_and_infrastructure_always_runs(services):
    for name in INFRA:
        assert "profiles" not in services[name], name
    for name in CPU.values():
        assert services[name]["profiles"] == ["cpu"], name
    for name in GPU.values():
        assert services[name]["profiles"] == ["gpu"], name
    assert set(services) == {*INFRA, *CPU.values(), *GPU.values()}


def test_gpu_services_reserve_nvidia_gpus_and_cpu_ones_do_not(services):
    for worker in ("prefill", "decode"):
        devices = services[GPU[worker]]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, worker
        (device,) = devices
        assert device["driver"] == "nvidia", worker
        assert "gpu" in device["capabilities"], worker
        assert device.get("count") or device.get("device_ids"), worker
    prefill_gpus = services["prefill"]["deploy"]["resources"]["reservations"]["devices"][0]
    decode_gpus = services["decode"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert prefill_gpus["device_ids"] != decode_gpus["device_ids"], "P and D share a GPU"
    for name in (*CPU.values(), GPU["gateway"]):
        assert "deploy" not in services[name], name


def _start_stack_argvs(monkeypatch, settings: up.StackSettings) -> dict[str, list[str]]:
    """The argv `splitserve.launch.up.start_stack` gives each service (nothing is started), with the
    free ports it picks replaced by the fixed ones compose gives that service."""
    launched: list[list[str]] = []

    class NoProcess:
        def __init__(self, args, *_, **__):
            launched.append(list(args))
            self.args = args

        def poll(self):
            return None

    picks = iter(range(61001, 62000))  # stand-ins for free ports, told apart afterwards
    monkeypatch.setattr(up.subprocess, "Popen", NoProcess)
    monkeypatch.setattr(up, "free_port", lambda host: next(picks))
    stack = up.start_stack(settings, wait=False)
    if stack.secrets is not None:
        stack.secrets.close()
    argvs = {}
    for argv in launched:
        assert argv[:3] == [sys.executable, "-m", "splitserve.cli"]
        kind = argv[3]
        (name,) = [n for n in stack.ports if n.split("-")[0] == kind]
        fixed = {
            str(stack.ports[name]): str(GRPC_PORTS[kind]),
            str(stack.metrics_ports[name]): str(METRICS_PORTS[kind]),
        }
        argvs[kind] = [fixed.get(arg, arg) for arg in argv[3:]]
    return argvs


def _redis_url() -> str:
    return "redis://redis:6379/0"  # the password comes from a secret file, never argv


def test_cpu_profile_runs_the_same_commands_as_the_e2e_tests(monkeypatch, services):
    model = services["decode-cpu"]["command"][2]
    expected = _start_stack_argvs(
        monkeypatch,
        up.StackSettings(
            model=model,
            redis_url=_redis_url(),
            host="0.0.0.0",
            api_keys=("compose-test-key",),  # beyond loopback: keys (given in a secret file)
            port=GRPC_PORTS["gateway"],
            extra_worker_args=WORKER_ARGS,
            metrics=True,
        ),
    )
    assert set(expected) == set(SERVICES)
    for name in SERVICES:
        assert services[CPU[name]]["command"] == expected[name], name


def test_gpu_profile_runs_the_commands_of_splitserve_up_with_a_model(monkeypatch, services):
    expected = _start_stack_argvs(
        monkeypatch,
        up.StackSettings(
            model="/models/model",
            redis_url=_redis_url(),
            host="0.0.0.0",
            api_keys=("compose-test-key",),  # beyond loopback: keys (given in a secret file)
            port=GRPC_PORTS["gateway"],
            metrics=True,
        ),
    )
    for name in SERVICES:
        assert services[GPU[name]]["command"] == expected[name], name
        mounts = [v["target"] for v in services[GPU[name]]["volumes"]]
        assert "/models/model" in mounts, name


def test_cpu_profile_serves_the_tiny_model_the_image_carries(monkeypatch, services):
    monkeypatch.setenv("XDG_CACHE_HOME", runtime_env()["XDG_CACHE_HOME"])
    for name in CPU.values():
        assert services[name]["command"][1:3] == ["--model", str(tiny_model_dir())], name


def test_each_service_listens_advertises_and_exports_where_the_others_look(services):
    for profile in (CPU, GPU):
        for name, compose_name in profile.items():
            service = services[compose_name]
            env = environment(service)
            argv = service["command"]
            assert argv[argv.index("--port") + 1] == str(GRPC_PORTS[name]), compose_name
            assert env["SPLITSERVE_PORT"] == str(GRPC_PORTS[name]), compose_name  # healthcheck
            assert argv[argv.index("--metrics-port") + 1] == str(METRICS_PORTS[name])
            drain_s = float(argv[argv.index("--drain-timeout-s") + 1])
            assert _seconds(service["stop_grace_period"]) >= drain_s + 10, compose_name
            assert env["SPLITSERVE_ADVERTISE_HOST"] == name, compose_name
            assert env["OTEL_SERVICE_NAME"] == f"splitserve-{name}", compose_name
            assert env["OTEL_TRACES_EXPORTER"] == "otlp", compose_name
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
            if compose_name != name:  # reachable under the same name in both profiles
                assert name in service["networks"]["default"]["aliases"], compose_name
            assert service["stop_signal"] == "SIGTERM", compose_name
        gateway = services[profile["gateway"]]
        assert gateway["ports"] == [f"127.0.0.1:{GRPC_PORTS['gateway']}:{GRPC_PORTS['gateway']}"]


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(
        float(number) * units[unit] for number, unit in re.findall(r"([\d.]+)(ms|s|m|h)", duration)
    )


def test_mounted_files_exist(services):
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if source.startswith("./deploy/"):
                assert (REPO / source).is_file(), (name, source)


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("$$HOME ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d}", env) == (
        "$HOME x x d d "
    )
    assert interpolate("${SET:+r}${UNSET:+r}", env) == "r"
    with pytest.raises(MissingVariable):
        interpolate("${EMPTY:?needed}", env)


# ---- the health probe itself, against a real grpc.health.v1 server


@pytest.fixture
def health_server():
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def _probe(services: dict[str, dict[str, Any]], port: int) -> int:
    test = services["decode-cpu"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    env = {"SPLITSERVE_PORT": str(port), "PATH": ""}
    return subprocess.run(
        [sys.executable, "-c", test[3]], env=env, capture_output=True, timeout=60
    ).returncode


def test_the_healthcheck_passes_only_while_the_service_is_serving(services, health_server):
    from grpc_health.v1 import health_pb2

    servicer, port = health_server
    status = health_pb2.HealthCheckResponse
    servicer.set("", status.NOT_SERVING)
    assert _probe(services, port) != 0
    servicer.set("", status.SERVING)
    assert _probe(services, port) == 0
    servicer.enter_graceful_shutdown()  # what SIGTERM draining does
    assert _probe(services, port) != 0


def test_the_healthcheck_fails_when_nothing_listens(services):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert _probe(services, port) != 0


def test_every_splitserve_service_runs_the_same_healthcheck(services):
    checks = [services[name]["healthcheck"] for name in (*CPU.values(), *GPU.values())]
    assert all(check == checks[0] for check in checks)


def test_secrets_are_files_and_no_command_holds_one(services):
    doc = load_yaml(COMPOSE_FILE)
    assert set(doc["secrets"]) == {"redis-password", "cluster-secret", "api-keys"}
    assert all("environment" in secret for secret in doc["secrets"].values())
    for profile in (CPU, GPU):
        for name, compose_name in profile.items():
            service = services[compose_name]
            env = environment(service)
            wanted = {"redis-password", "cluster-secret"} | (
                {"api-keys"} if name == "gateway" else set()
            )
            assert set(service["secrets"]) == wanted, compose_name
            for secret in wanted:
                variable = {"api-keys": "SPLITSERVE_API_KEY_FILE"}.get(
                    secret, f"SPLITSERVE_{secret.replace('-', '_').upper()}_FILE"
                )
                assert env[variable] == f"/run/secrets/{secret}", (compose_name, variable)
    for name, service in services.items():
        assert PASSWORD not in " ".join(_strings(service.get("command", []))), name
