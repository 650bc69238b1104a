"""`splitserve up` takes every worker setting: walking the workers' own flags (and the settings
classes they are made from), each is in `up --help` (per-role overrides too), and a value given
to `up` reaches each worker's settings as the worker builds them from its command line: both
roles for a general flag, one role for `--prefill-<flag>` / `--decode-<flag>`, the gateway too
for what it shares. Nothing starts here (cli/up_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import pytest

from splitserve.cli import build_parser, main
from splitserve.cli.up_flags import PER_ROLE, TOPICS, UP_OWNS, stack_worker_args, worker_flags
from splitserve.runtime.settings import ServiceSettings, WorkerSettings, from_args, parse_bool

# Plausible values for the string settings (two each for those a role may override)
STRINGS = {
    "dtype": ("float16",),
    "device": ("cpu", "cuda:1"),
    "async_scheduling": ("on", "off"),
    "kv_transport": ("grpc",),
    "load_format": ("dummy",),
    "quantization": ("fp8",),
    "kv_cache_dtype": ("fp8",),
    "speculative_method": ("ngram", "draft"),
    "speculative_model": ("/models/draft-a", "/models/draft-b"),
    "lora_modules": ("sql=/adapters/sql,chat=/adapters/chat",),
    "engine_core": ("thread",),
    "advertise_host": ("10.0.0.7",),
    "model_name": ("served",),
    "metrics_host": ("127.0.0.2",),
}


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser({})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _worker_actions(commands: dict[str, argparse.ArgumentParser]) -> dict[str, argparse.Action]:
    """Every flag of `splitserve prefill` and `splitserve decode`, by its dest."""
    return {
        a.dest: a
        for kind in ("prefill", "decode")
        for a in commands[kind]._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }


def _sample(action: argparse.Action, k: int = 0) -> tuple[str | None, Any]:
    """A value other than the worker's default, as typed on the command line (None: a switch)
    and as the worker reads it."""
    if action.nargs == 0:
        return None, True
    if action.type is parse_bool:
        return ("off", False) if action.default else ("on", True)
    if action.type is int:
        value = (action.default or 20) + 3 + 2 * k
        return str(value), value
    if action.type is float:
        value = (action.default or 1.0) / (2 + 2 * k)
        return str(value), value
    text = STRINGS.get(action.dest, (f"x-{action.dest}", f"y-{action.dest}"))[k]
    return text, text


def _up(*argv: str | None) -> argparse.Namespace:
    return build_parser({}).parse_args(["up", *(a for a in argv if a is not None)])


def _worker(commands: dict[str, argparse.ArgumentParser], kind: str, argv: tuple[str, ...]):
    """The worker's parsed command line as `up` starts it (general flags, then its role's)."""
    return commands[kind].parse_args(["--model", "m", "--redis-url", "redis://r", *argv])


def _in_help(option: str, help_text: str) -> bool:
    return re.search(rf"^\s+{re.escape(option)}(?![\w-])", help_text, re.M) is not None


def test_the_walk_covers_every_worker_setting(commands):
    names = set(_worker_actions(commands))
    fields = {f.name for cls in (ServiceSettings, WorkerSettings) for f in dataclasses.fields(cls)}
    assert fields <= names
    assert names == {f.name for f in worker_flags()} | set(UP_OWNS)
    assert fields - set(UP_OWNS) >= PER_ROLE
    topics = {name for names in TOPICS.values() for name in names}
    assert {f.name for f in worker_flags()} <= topics, "a worker flag without a topic"


def test_every_worker_flag_is_in_up_help_with_its_per_role_overrides(commands):
    help_text = commands["up"].format_help()
    up_dests = {a.dest for a in commands["up"]._actions}
    for name, action in _worker_actions(commands).items():
        flag = action.option_strings[-1]
        if name in UP_OWNS:  # up's own flag of the same meaning, or up picks it per worker
            owner = UP_OWNS[name].split()[0]
            assert not owner.startswith("--") or _in_help(owner, help_text), (name, owner)
            assert not {f"{r}__{name}" for r in ("worker", "prefill", "decode")} & up_dests
            continue
        assert _in_help(flag, help_text), flag
        for role in ("prefill", "decode"):
            per_role = f"--{role}-{flag[2:]}"
            assert _in_help(per_role, help_text) == (name in PER_ROLE), per_role
    for topic in TOPICS:
        assert f"worker settings: {topic}:" in help_text


def test_a_value_given_to_up_reaches_both_roles_settings(commands):
    for name, action in _worker_actions(commands).items():
        if name in UP_OWNS:
            continue
        typed, value = _sample(action)
        passed = stack_worker_args(_up(action.option_strings[-1], typed), {})
        assert passed.prefill == passed.decode == (), name
        for kind in ("prefill", "decode"):
            worker = _worker(commands, kind, passed.workers)
            assert getattr(worker, name) == value, (name, kind, passed.workers)
            for cls in (ServiceSettings, WorkerSettings):  # the worker's effective settings
                if name in {f.name for f in dataclasses.fields(cls)}:
                    assert getattr(from_args(cls, worker), name) == value, (name, kind)
        gateway = _worker(commands, "gateway", passed.gateway) if passed.gateway else None
        shares = name in {f.name for f in dataclasses.fields(ServiceSettings)} | {"block_size"}
        assert (gateway is not None) == shares, name
        if gateway is not None:
            assert getattr(gateway, name) == value, name


def test_a_per_role_value_reaches_only_its_role_and_wins_over_the_general_one(commands):
    actions = _worker_actions(commands)
    for name in sorted(PER_ROLE):
        action = actions[name]
        flag = action.option_strings[-1]
        general, general_value = _sample(action, 0)
        own, own_value = _sample(action, 1)
        for role, other in (("prefill", "decode"), ("decode", "prefill")):
            override = f"--{role}-{flag[2:]}"
            passed = stack_worker_args(_up(flag, general, override, own), {})
            assert passed.gateway == ()
            role_argv = (*passed.workers, *getattr(passed, role))
            other_argv = (*passed.workers, *getattr(passed, other))
            assert getattr(_worker(commands, role, role_argv), name) == own_value, override
            assert getattr(_worker(commands, other, other_argv), name) == general_value, override
            alone = stack_worker_args(_up(override, own), {})
            assert alone.workers == () and getattr(alone, other) == ()
            assert getattr(_worker(commands, other, ()), name) == action.default  # its own


def test_up_passes_only_what_it_is_given():
    assert stack_worker_args(_up(), {}) == type(stack_worker_args(_up(), {}))()
    passed = stack_worker_args(_up("--prefill", "2", "--decode", "3", "--metrics"), {})
    assert (passed.workers, passed.prefill, passed.decode, passed.gateway) == ((), (), (), ())


def test_a_bad_worker_value_is_refused_by_up_before_anything_starts(monkeypatch, capsys):
    import splitserve.launch.up as up

    started: list[Any] = []
    monkeypatch.setattr(up, "run_until_interrupted", lambda settings: started.append(settings) or 0)
    for argv, says in (
        (["--max-num-seqs", "lots"], "argument --max-num-seqs: invalid int value: 'lots'"),
        (["--decode-pdl", "1"], "unrecognized arguments: --decode-pdl"),
        (["--engine-core", "fiber"], "--engine-core must be process or thread"),
        (["--decode-stream-interval", "2"], "unrecognized arguments"),
        (["--heartbeat-ttl-s", "0"], "--heartbeat-ttl-s must be a finite number of seconds > 0"),
        (["--prefill", "0", "--prefill-max-num-seqs", "4"], "--prefill 0 starts no prefill"),
        (["--devices", "cpu,cpu", "--decode-device", "cpu"], "not both"),
        (["--worker-id", "mine"], "unrecognized arguments: --worker-id"),
    ):
        try:
            code = main(["up", *argv])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        assert code == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (argv, err)
    assert not started


def test_up_hands_the_worker_flags_to_the_stack(monkeypatch):
    import splitserve.launch.up as up

    started: list[Any] = []
    monkeypatch.setattr(up, "run_until_interrupted", lambda settings: started.append(settings) or 0)
    argv = ["up", "--max-num-seqs", "7", "--block-size", "8", "--lora-modules", "a=/x"]
    argv += ["--decode-max-model-len", "96", "--prefill-tensor-parallel-size", "2"]
    assert main([*argv, "--role-switch"]) == 0
    (settings,) = started
    assert settings.extra_worker_args == (
        "--block-size=8", "--max-num-seqs=7", "--lora-modules=a=/x", "--role-switch",
    )  # fmt: skip
    assert settings.extra_prefill_args == ("--tensor-parallel-size=2",)
    assert settings.extra_decode_args == ("--max-model-len=96",)
    assert settings.extra_gateway_args == ("--block-size=8",)
