"""Typed settings for each service, from command-line flags with environment fallbacks.

Every flag `--some-name` can also come from `SPLITSERVE_SOME_NAME` (compose and Kubernetes set
those). The environment is read once, in `main`, and passed in here.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServiceSettings:
    """What every service process needs."""

    model: str
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    advertise_host: str = ""  # the host others use to reach this one (default: `host`)

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host


@dataclass(frozen=True)
class WorkerSettings:
    """Engine and lease settings of a prefill or decode worker."""

    dtype: str = "auto"  # bfloat16 on a GPU, float32 on the CPU
    device: str = "auto"  # the GPU when there is one
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    lease_s: float = 10.0
    heartbeat_ttl_s: float = 3.0


@dataclass(frozen=True)
class GatewaySettings:
    max_inflight: int = 256
    local_prefill_tokens: int = 0
    routing_policy: str = "least-loaded-prefix"
    request_timeout_s: float = 600.0
    block_size: int = 16
    model_name: str = ""


def add_flags(
    parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str], skip: tuple[str, ...] = ()
) -> None:
    """One `--flag` per dataclass field, its default taken from SPLITSERVE_<FIELD> if set."""
    for field in dataclasses.fields(cls):
        name = field.name
        if name in skip:
            continue
        default = None if field.default is dataclasses.MISSING else field.default
        env_value = env.get(f"SPLITSERVE_{name.upper()}")
        kind = _field_type(field.type)
        if env_value is not None:
            default = kind(env_value)
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=default)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    values.update(overrides)
    return cls(**values)


def _field_type(annotation: Any) -> type:
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def default_worker_id(kind: str) -> str:
    return f"{kind}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
