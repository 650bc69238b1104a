"""`splitserve up` takes what the workers take: every flag of `splitserve prefill|decode`,
mirrored from the workers' own definitions (`serve.add_worker_flags`, hence `runtime/settings.py`
and `flag_help.py`), and the worker command lines that a stack's values make.

    splitserve up --max-num-seqs 64 --decode-max-model-len 4096 --block-size 32
       ├── prefill-N  … --block-size=32 --max-num-seqs=64
       ├── decode-N   … --block-size=32 --max-num-seqs=64 --max-model-len=4096
       └── gateway    … --block-size=32

- Only a value given to `up` is passed on, as the worker's own `--flag=value`; a flag not given
  leaves every worker its own default (and the `SPLITSERVE_*` environment it inherits).
- `--prefill-<flag>` / `--decode-<flag>` exist for the settings in `PER_ROLE`: those that shape
  one worker's own engine and nothing a peer relies on (device and parallelism, memory and the
  KV pool's size, batch and context limits, step scheduling, speculative decoding). They follow
  the general flags on the worker's command line, so they win. What the roles must agree on
  (dtype, weights and quantization, block size, KV cache dtype, KV transport, LoRA adapters)
  or what concerns the stack as a whole (registry, leases, liveness) has one value for all.
- `up` sets some worker flags itself (`UP_OWNS`): its own flags of the same meaning (`--model`,
  `--host`, …), and what it picks per worker (ports, ids, secrets); they are not mirrored.
- A setting that the gateway has too, with the same meaning (`WorkerFlag.gateway_too`: the
  settings every service has, and the block size they must agree on), goes to it as well.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode")

# Worker flags that `up` gives each worker itself, and what stands for them on `up`.
UP_OWNS = {
    "model": "--model",
    "redis_url": "--redis-url",
    "host": "--host",
    "drain_timeout_s": "--drain-timeout-s",
    "insecure": "--insecure",
    "port": "a free port per worker (up's --port is the gateway's)",
    "kv_port": "each decode worker's own free port (a fixed one would collide between them)",
    "metrics_port": "--metrics (a free port per service)",
    "worker_id": "prefill-N, decode-N",
    "colocated": "--prefill 0",
    "cluster_secret_file": "a fresh cluster secret per stack when one is needed",
    "redis_password_file": "a fresh password for the Redis it starts",
}

# Settings that may differ between the roles: `--prefill-<flag>` and `--decode-<flag>` too.
PER_ROLE = frozenset(
    {
        "device",
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "kv_host_cache_gb",
        "num_kv_blocks",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "async_scheduling",
        "speculative_method",
        "num_speculative_tokens",
        "speculative_model",
        "speculative_draft_layers",
        "speculative_draft_catch_up_tokens",
    }
)

# `up --help` groups the worker flags by what they concern (argparse argument groups).
TOPICS: dict[str, tuple[str, ...]] = {
    "model and weights": ("dtype", "quantization", "load_format", "model_name"),
    "device and parallelism": ("device", "tensor_parallel_size", "engine_core", "role_switch"),
    "memory and KV cache": (
        "gpu_memory_utilization", "kv_cache_memory_bytes", "kv_host_cache_gb", "num_kv_blocks",
        "block_size",
        "kv_cache_dtype", "kv_transport",
    ),
    "batching and scheduling": (
        "max_model_len", "max_num_batched_tokens", "max_num_seqs", "async_scheduling", "pdl",
        "stream_interval", "max_reservations_per_caller",
    ),
    "speculative decoding": (
        "speculative_method", "num_speculative_tokens", "speculative_model",
        "speculative_draft_layers", "speculative_draft_catch_up_tokens",
    ),
    "LoRA adapters": ("enable_lora", "lora_modules", "max_loras", "max_lora_rank"),
    "registry, leases and liveness": (
        "lease_s", "heartbeat_ttl_s", "engine_stall_s", "registry_retry_s", "advertise_host",
        "metrics_host",
    ),
}  # fmt: skip
OTHER_TOPIC = "other worker settings"  # a new setting without a topic lands here

DESCRIPTION = (
    "Every flag of `splitserve prefill|decode` is a flag of up too (the worker groups below): "
    "given here, it reaches every worker as that flag; not given, each worker keeps its own "
    "default (or its SPLITSERVE_* environment). --prefill-<flag> / --decode-<flag> set a "
    "setting that may differ between the roles (a worker's device, parallelism, memory, batch "
    "and context limits, scheduling, speculative decoding) for one role only, over the general "
    "flag. Worker settings the gateway has too (block size, the settings of every service) go "
    "to it as well."
)


@dataclass(frozen=True)
class WorkerFlag:
    """One worker flag as `up` mirrors it."""

    name: str  # the worker's dest: a settings field's name
    flag: str  # the worker's option, e.g. --max-num-seqs
    action: argparse.Action  # the worker's own definition (type, metavar, help)

    @property
    def per_role(self) -> bool:
        return self.name in PER_ROLE

    @property
    def gateway_too(self) -> bool:
        return self.name in _gateway_settings()

    @property
    def switch(self) -> bool:
        """A flag without a value (store_true)."""
        return self.action.nargs == 0

    def dest(self, role: str = "") -> str:
        """Where `up` keeps its value: a namespace of its own per role, apart from up's own."""
        return f"{role or 'worker'}__{self.name}"

    def option(self, role: str = "") -> str:
        return f"--{role}-{self.flag[2:]}" if role else self.flag

    def argv(self, value: Any) -> list[str]:
        """The worker's command-line flag carrying `value` (as `--flag=value`, so that a value
        starting with '-', or an empty one, stays one argument)."""
        if self.switch:
            return [self.flag] if value else []
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return [f"{self.flag}={text}"]


@dataclass(frozen=True)
class StackWorkerArgs:
    """What `up` appends to each service's command line (StackSettings' `extra_*_args`)."""

    workers: tuple[str, ...] = ()  # both roles
    prefill: tuple[str, ...] = ()  # after `workers`, so they win
    decode: tuple[str, ...] = ()
    gateway: tuple[str, ...] = ()


def worker_flags() -> tuple[WorkerFlag, ...]:
    """Every flag of a prefill or decode worker that `up` mirrors (all but `UP_OWNS`), in the
    workers' own order, from the workers' own parsers."""
    from splitserve.cli.serve import add_worker_flags

    found: dict[str, WorkerFlag] = {}
    for kind in ROLES:
        parser = argparse.ArgumentParser(add_help=False)
        add_worker_flags(parser, {}, kind)
        for action in parser._actions:
            name = action.dest
            if name in UP_OWNS or name in found or not action.option_strings:
                continue
            flag = next(o for o in action.option_strings if o.startswith("--"))
            found[name] = WorkerFlag(name, flag, action)
    return tuple(found.values())


def add_up_worker_flags(up: argparse.ArgumentParser) -> None:
    """Mirror every worker flag into `up`'s parser, grouped by topic; no defaults, so that only
    what the user gives is passed on. The types are the workers' own: a bad value is refused by
    `up` before anything starts."""
    up.usage = "%(prog)s [up's options] [worker settings, --prefill-<flag>, --decode-<flag>]"
    order = [name for names in TOPICS.values() for name in names]
    flags = sorted(worker_flags(), key=lambda f: order.index(f.name) if f.name in order else 999)
    groups = {t: up.add_argument_group(f"worker settings: {t}") for t in (*TOPICS, OTHER_TOPIC)}
    for flag in flags:
        group = groups[_topic(flag.name)]  # NOTE: --help leaves out a group with no flag
        gateway_too = "; the gateway takes it too" if flag.gateway_too else ""
        _mirror(group, flag, "", f"{flag.action.help}{gateway_too}")
        if flag.per_role:
            for role in ROLES:
                _mirror(group, flag, role, f"{flag.flag}, for the {role} workers only")


def stack_worker_args(args: argparse.Namespace, env: Mapping[str, str]) -> StackWorkerArgs:
    """The worker (and gateway) flags that `up`'s command line gives, after the checks that are
    cheap before anything starts: each role's settings as its workers will build them."""
    flags = worker_flags()
    given = {  # "": the general flags, else one role's
        role: [(f, getattr(args, f.dest(role))) for f in flags if hasattr(args, f.dest(role))]
        for role in ("", *ROLES)
    }
    if args.prefill == 0 and given["prefill"]:
        options = ", ".join(f.option("prefill") for f, _ in given["prefill"])
        raise ValueError(f"{options}: --prefill 0 starts no prefill workers")
    devices = [f.option(role) for role, fv in given.items() for f, _ in fv if f.name == "device"]
    if args.devices and devices:
        raise ValueError(
            f"--devices hands each worker a device in turn: give it or {', '.join(devices)}, "
            "not both"
        )
    made = StackWorkerArgs(
        workers=_argv(given[""]),
        prefill=_argv(given["prefill"]),
        decode=_argv(given["decode"]),
        gateway=_argv([(f, v) for f, v in given[""] if f.gateway_too]),
    )
    for role in ROLES if args.prefill else ("decode",):
        check_worker_argv(role, [*made.workers, *getattr(made, role)], env)
    return made


def check_worker_argv(kind: str, argv: list[str], env: Mapping[str, str]) -> None:
    """Build a `kind` worker's settings from `argv` as the worker will (its own parser and
    settings classes): a value they refuse is a ValueError now, not a worker dying later."""
    from splitserve.cli.serve import add_worker_flags
    from splitserve.runtime.settings import ServiceSettings, WorkerSettings, from_args

    parser = argparse.ArgumentParser(prog=f"splitserve {kind}", add_help=False)
    add_worker_flags(parser, env, kind)
    parsed = parser.parse_args(["--model", "m", "--redis-url", "redis://", *argv])
    try:
        from_args(ServiceSettings, parsed)
        from_args(WorkerSettings, parsed)
    except ValueError as exc:
        raise ValueError(f"the {kind} workers' settings: {exc}") from None


def _mirror(group: Any, flag: WorkerFlag, role: str, help_text: str) -> None:
    kwargs: dict[str, Any] = {"help": help_text}
    if not flag.switch:
        kwargs.update(type=flag.action.type, metavar=flag.action.metavar)
        kwargs.update(choices=flag.action.choices, nargs=flag.action.nargs)
    group.add_argument(
        flag.option(role),
        action=type(flag.action),
        dest=flag.dest(role),
        default=argparse.SUPPRESS,
        **kwargs,
    )


def _argv(values: list[tuple[WorkerFlag, Any]]) -> tuple[str, ...]:
    return tuple(arg for flag, value in values for arg in flag.argv(value))


def _topic(name: str) -> str:
    return next((t for t, names in TOPICS.items() if name in names), OTHER_TOPIC)


def _gateway_settings() -> frozenset[str]:
    """Worker settings that the gateway has with the same meaning: every service's settings,
    and the block size that every worker and the gateway must agree on."""
    from splitserve.runtime.settings import ServiceSettings

    return frozenset(f.name for f in dataclasses.fields(ServiceSettings)) | {"block_size"}
