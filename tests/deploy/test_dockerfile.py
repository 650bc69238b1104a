"""The Dockerfile, parsed by BuildKit's parser: stages, base images, user, ports, health, and
what the build context leaves out."""

from __future__ import annotations

import fnmatch

from tests.deploy.helpers import (
    DOCKERFILE,
    GRPC_PORTS,
    METRICS_PORTS,
    REPO,
    compose_services,
    dockerfile_commands,
    global_args,
    normalized,
    pyproject,
    runtime_env,
    stages,
)

# Every instruction the Dockerfile reference defines (the parser accepts any word).
INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


def _final(cmd: str) -> list:
    return [c for c in stages()[-1] if c.cmd == cmd]


def test_dockerfile_parses_into_known_instructions():
    commands = dockerfile_commands()
    assert commands and commands[0].cmd in ("ARG", "FROM")
    assert {c.cmd for c in commands} <= INSTRUCTIONS


def test_it_is_multi_stage_on_a_cuda_runtime_by_default_with_a_cpu_variant():
    args = global_args()
    assert args["BASE"].startswith("nvidia/cuda:") and "-runtime-" in args["BASE"]
    assert args["TORCH_VARIANT"].startswith("cu")
    names = [stage[0].value for stage in stages()]
    assert len(names) >= 2
    assert names[0][0] == "${BASE}"
    build_runs = " ".join(c.value[0] for c in stages()[1] if c.cmd == "RUN")
    # torch from the index TORCH_VARIANT picks; `cpu` is https://download.pytorch.org/whl/cpu
    assert '--index-url "${TORCH_INDEX_URL}"' in build_runs
    index = [c.value[0] for c in stages()[1] if c.cmd == "ARG" and "TORCH_INDEX_URL" in c.value[0]]
    assert index == ["TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}"]
    assert "pip install ." in build_runs
    # compose builds the cpu variant from the same file
    cpu = compose_services({"REDIS_PASSWORD": "x"})["decode-cpu"]["build"]["args"]
    assert cpu["TORCH_VARIANT"] == "cpu" and not cpu["BASE"].startswith("nvidia/")


def test_runtime_copies_only_the_build_results():
    copies = _final("COPY")
    assert copies and all(c.flags == ("--from=build",) for c in copies)


def test_runtime_runs_as_a_numeric_non_root_user():
    (user,) = _final("USER")
    uid_default = [c.value[0] for c in stages()[-1] if c.cmd == "ARG" and c.value[0][:4] == "UID="]
    uid = uid_default[0].split("=", 1)[1]
    assert user.value[0] == "${UID}:${UID}" and uid.isdigit() and int(uid) >= 1000


def test_entrypoint_is_splitserve():
    (entrypoint,) = _final("ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("splitserve",)
    # `splitserve X` in a container is `python -m splitserve.cli X`, what the e2e tests run.
    assert pyproject()["project"]["scripts"]["splitserve"] == "splitserve.cli:main"


def test_it_exposes_every_grpc_and_metrics_port():
    (expose,) = _final("EXPOSE")
    assert {int(p) for p in expose.value} == {*GRPC_PORTS.values(), *METRICS_PORTS.values()}


def test_healthcheck_is_the_grpc_probe_compose_runs():
    (check,) = _final("HEALTHCHECK")
    assert check.json and check.value[:3] == ("CMD", "python", "-c")
    compose_test = compose_services({"REDIS_PASSWORD": "x"})["decode-cpu"]["healthcheck"]["test"]
    assert normalized(check.value[3]) == normalized(compose_test[3])


def test_stop_signal_is_sigterm_which_drains():
    (stop,) = _final("STOPSIGNAL")
    assert stop.value == ("SIGTERM",)


def test_the_default_model_and_caches_fit_a_read_only_root():
    env = runtime_env()
    assert env["XDG_CACHE_HOME"].startswith("/opt/splitserve/")
    for name in ("HF_HOME", "TRITON_HOME", "TRITON_CACHE_DIR"):
        assert env[name].startswith("/tmp"), name
    build = " ".join(c.value[0] for c in stages()[1] if c.cmd == "RUN")
    assert "ensure_tiny_model()" in build
    assert env["SPLITSERVE_MODEL"] == "tiny"  # what the image carries: nothing is fetched


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.replace("**/", "")):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_secrets_and_tests_out_and_the_packages_in():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in (".env", ".git", "tests", "deploy", "compose.yaml", "splitserve.egg-info"):
        assert _ignored(path, patterns), path
    project = pyproject()
    needed = ["pyproject.toml", project["project"]["readme"], "splitserve", "constraints.txt"]
    for path in needed:
        assert (REPO / path).exists(), path
        assert not _ignored(path, patterns), path
    assert DOCKERFILE.name in patterns  # not needed inside the image
