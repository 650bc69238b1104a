"""Typed settings for each service, from command-line flags with environment fallbacks.

Every flag `--some-name` can also come from `SPLITSERVE_SOME_NAME` (compose and Kubernetes set
those). The environment is read once, in `main`, and passed in here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.runtime.flag_help import flag_help


@dataclass(frozen=True)
class ServiceSettings:
    """What every service process needs."""

    model: str
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    advertise_host: str = ""  # the host others use to reach this one (default: `host`)
    model_name: str = ""  # the served model's name (default: the model directory's name)
    metrics_port: int = 0  # Prometheus /metrics on this port (0: off)
    # /metrics listens on this address (default: `host`); off loopback it asks for the
    # cluster secret as a bearer token (runtime/security.py)
    metrics_host: str = ""
    drain_timeout_s: float = 30.0  # on SIGTERM: how long to wait for requests in flight
    # How long a registry call on a request's path retries while Redis is unreachable before
    # the request fails UNAVAILABLE.
    registry_retry_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            check_port(f"--{name.replace('_', '-')}", getattr(self, name))
        for name in ("drain_timeout_s", "registry_retry_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                flag = f"--{name.replace('_', '-')}"
                raise ValueError(f"{flag} must be a finite number of seconds >= 0, got {value}")

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: `metrics_host`, else `host`."""
        return self.metrics_host or self.host

    @property
    def served_model_name(self) -> str:
        """`gen_ai.request.model` in traces and the `model_name` label of every metric."""
        return self.model_name or self.model.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class WorkerSettings:
    """Engine and lease settings of a prefill or decode worker."""

    dtype: str = "auto"  # bfloat16 on a GPU, float32 on the CPU
    device: str = "auto"  # the GPU when there is one
    block_size: int = 16
    num_kv_blocks: int | None = None
    # The KV pool's bytes; unset: GPU by --gpu-memory-utilization, CPU 512 MiB.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # A host-memory KV tier behind the prefix cache, in GiB (pinned; engine/host_tier.py)
    kv_host_cache_gb: float | None = None
    max_model_len: int | None = None  # unset: the model's own
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    lease_s: float = 10.0
    # A frozen worker's record lapses after this long: the gateway moves its streams then
    heartbeat_ttl_s: float = 1.5
    # A worker whose engine loop has not turned for this long leaves the registry until it
    # does (runtime/engine_watch.py); paced: three times the loop's recent longest wait when
    # that is longer (runtime/pace.py)
    engine_stall_s: float = 2.0
    pdl: bool = True  # programmatic dependent launch in the GPU kernels (SPLITSERVE_PDL=0: off)
    # Overlapped decode steps (engine/overlap.py): auto turns them on with CUDA graphs
    async_scheduling: str = "auto"  # auto | on | off
    kv_transport: str = "auto"  # auto | nixl | grpc: how KV moves between workers
    kv_port: int = 0  # a decode worker's gRPC KV receiver port (0: a free one; published)
    # safetensors reads the checkpoint; dummy fills random weights of its shape (benchmarks)
    load_format: str = "safetensors"
    # FP8 weights: auto runs the checkpoint as stored; fp8 quantizes a 16/32-bit one at load
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8: every worker must agree
    # Speculative decoding (engine/spec_decode/): ngram | draft; empty: off. Prefill-only
    # requests never speculate, so it matters on decode (and colocated) workers.
    speculative_method: str = ""
    num_speculative_tokens: int = 4  # K, the most tokens proposed per sequence per step
    speculative_model: str = ""  # --speculative-method draft: the draft checkpoint's directory
    # --speculative-method draft without --speculative-model: the target's first k layers
    speculative_draft_layers: int = 0
    # a draft checkpoint's prompt catch-up per step (an admitted prompt); 0: the engine's default
    speculative_draft_catch_up_tokens: int = 0
    # LoRA adapters (engine/lora): --lora-modules name=DIR entries (comma or space separated)
    # load at start; --enable-lora alone serves adapters loaded at run time
    enable_lora: bool = False
    lora_modules: str = ""
    max_loras: int = 4
    max_lora_rank: int = 16
    # GPUs (one engine process each) the model is sharded over: --device's and the next N-1
    tensor_parallel_size: int = 1
    # A decode worker's reservations (not yet decoding) per client the gateway acts for (0: no
    # limit), so that one client can't hold the whole KV pool
    max_reservations_per_caller: int = 0
    # Where the engine loop runs: process (its own interpreter, docs/design.md "Processes") or
    # thread (in the worker's process: for tests that reach inside it)
    engine_core: str = "process"
    # Tokens per Decode-stream message at least (1: every step's); steps that queued up while
    # a stream was busy always go out as one message
    stream_interval: int = 1

    def __post_init__(self) -> None:
        for name in ("heartbeat_ttl_s", "engine_stall_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                flag = f"--{name.replace('_', '-')}"
                raise ValueError(f"{flag} must be a finite number of seconds > 0, got {value}")
        if self.engine_core not in ("process", "thread"):
            raise ValueError(f"--engine-core must be process or thread, got {self.engine_core!r}")
        if not 1 <= self.stream_interval <= 4096:
            raise ValueError(
                f"--stream-interval must be 1 to 4096 tokens per message, got "
                f"{self.stream_interval}"
            )


@dataclass(frozen=True)
class GatewaySettings:
    # Requests in flight at once, over all of the gateway's processes (each takes its share)
    max_inflight: int = 4096
    # Requests one API key may have in flight at once (0: only --max-inflight bounds them)
    max_inflight_per_key: int = 0
    # Tokens one API key may ask for per minute (prompt + n * max_tokens, the unused part given
    # back; 0: no limit)
    max_tokens_per_minute_per_key: int = 0
    local_prefill_tokens: int = 0
    routing_policy: str = "least-loaded-prefix"
    # What a prompt block in a worker's host-memory KV tier counts for in routing, 0 to 1 (a
    # GPU-cached block: 1); it is copied back, not recomputed (gateway/router.py)
    host_block_weight: float = 0.9
    # How tool calls are read out of the model's text on the HTTP API (docs/http.md): auto
    # (picked from the chat template), hermes (<tool_call> tags) or json (Llama 3's)
    tool_call_parser: str = "auto"
    request_timeout_s: float = 600.0
    block_size: int = 16
    # Prompt tokens given to one prefill worker at once; more requests wait in the gateway
    max_prefill_tokens_per_worker: int = 16384
    # Deadline of the calls that a healthy worker answers at once (Abort)
    rpc_timeout_s: float = 5.0
    # Deadline of a Reserve: a decode worker that misses it is suspect and another is asked;
    # paced: three times the worker's recent peak wait when that is longer (runtime/pace.py)
    reserve_timeout_s: float = 1.0
    # A Reserve unanswered this long is also sent to another decode worker, the first answer
    # wins (gateway/hedge.py): a frozen worker delays a new request about this much (0: off);
    # paced: twice the worker's recent peak Reserve answer when that is longer, at most 1 s
    reserve_hedge_s: float = 0.3
    # A Decode stream silent this long (paced as the Reserve deadline) has its worker's
    # liveness checked (then every quarter of it): gone from the registry, the stream moves
    stall_timeout_s: float = 1.0
    # A worker that missed a deadline gets no new requests for this long (others are live)
    suspect_s: float = 30.0
    # How often one stream may move to another decode worker when its own is lost
    max_migrations: int = 2
    # The OpenAI-compatible HTTP API on this port, beside gRPC (0: off)
    http_port: int = 0
    # New tokens per client message, per sample, when a request does not say (its
    # `stream_interval`): fewer, larger messages cost the gateway less (docs/deploy.md)
    stream_interval: int = 1
    # Milliseconds between a stream's client messages at least, when a request does not say
    # (its `stream_interval_ms`): tokens that come sooner go with the next message (0: off)
    stream_interval_ms: int = 0
    # Gateway processes sharing the ports (SO_REUSEPORT); 0: sized to the host (docs/deploy.md)
    processes: int = 0
    # Each gateway process keeps one DecodeMany call per decode worker, which carries every
    # Decode stream to it (one message per engine step, not one per stream; docs/deploy.md)
    decode_many: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.stream_interval <= 4096:
            raise ValueError(
                f"--stream-interval must be 1 to 4096 tokens per message, got "
                f"{self.stream_interval}"
            )
        if not 0 <= self.stream_interval_ms <= 10_000:
            raise ValueError(
                f"--stream-interval-ms must be 0 to 10000 ms between messages, got "
                f"{self.stream_interval_ms}"
            )
        if not 0 <= self.processes <= 256:
            raise ValueError(
                f"--processes must be 0 (sized to the host) to 256, got {self.processes}"
            )
        if not (math.isfinite(self.host_block_weight) and 0 <= self.host_block_weight <= 1):
            raise ValueError(
                f"--host-block-weight must be 0 to 1 (what a host-tier block counts for, a GPU "
                f"block's 1), got {self.host_block_weight}"
            )
        if not (math.isfinite(self.reserve_hedge_s) and self.reserve_hedge_s >= 0):
            raise ValueError(
                f"--reserve-hedge-s must be a finite number of seconds >= 0 (0: no hedge), got "
                f"{self.reserve_hedge_s}"
            )


TRACE_EXPORTERS = ("otlp", "console")


@dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry tracing, from the standard OTEL_* variables (read once, in `from_env`).

    Tracing is off unless OTEL_TRACES_EXPORTER names an exporter. Other OTEL_* variables the SDK
    understands (OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS, …)
    are left to it.
    """

    exporters: tuple[str, ...] = ()  # OTEL_TRACES_EXPORTER: otlp, console (comma-separated)
    service_name: str = ""  # OTEL_SERVICE_NAME (default: splitserve-<service>)
    endpoint: str = ""  # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT
    insecure: bool | None = None  # OTEL_EXPORTER_OTLP_[TRACES_]INSECURE
    schedule_delay_ms: float | None = None  # OTEL_BSP_SCHEDULE_DELAY

    def __post_init__(self) -> None:
        unknown = [name for name in self.exporters if name not in TRACE_EXPORTERS]
        if unknown:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER={','.join(self.exporters)}: unsupported {unknown}; "
                f"use none or any of {', '.join(TRACE_EXPORTERS)}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TracingSettings:
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        names = env.get("OTEL_TRACES_EXPORTER", "none").lower().split(",")
        exporters = tuple(n.strip() for n in names if n.strip() not in ("", "none"))
        protocol = env.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        )
        if "otlp" in exporters and protocol != "grpc":
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: only grpc is supported")
        insecure = env.get(
            "OTEL_EXPORTER_OTLP_TRACES_INSECURE", env.get("OTEL_EXPORTER_OTLP_INSECURE")
        )
        delay = env.get("OTEL_BSP_SCHEDULE_DELAY")
        return cls(
            exporters=exporters,
            service_name=env.get("OTEL_SERVICE_NAME", ""),
            endpoint=env.get(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
            ),
            insecure=None if insecure is None else insecure.strip().lower() == "true",
            schedule_delay_ms=None if delay is None else float(delay),
        )


def add_flags(
    parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str], skip: tuple[str, ...] = ()
) -> None:
    """One `--flag` per dataclass field, its default taken from SPLITSERVE_<FIELD> if set."""
    for field in dataclasses.fields(cls):
        name = field.name
        if name in skip:
            continue
        default = None if field.default is dataclasses.MISSING else field.default
        env_name = f"SPLITSERVE_{name.upper()}"
        env_value = env.get(env_name)
        kind = _field_type(field.type)
        if env_value is not None:
            try:
                default = kind(env_value)
            except ValueError as exc:
                raise ValueError(f"{env_name}={env_value!r}: {exc}") from None
        flag = f"--{name.replace('_', '-')}"
        parser.add_argument(
            flag, dest=name, type=kind, default=default, metavar=name.upper(), help=flag_help(name)
        )


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    values.update(overrides)
    return cls(**values)


def parse_bool(text: str) -> bool:
    """Command-line and environment booleans: 1/true/yes/on and 0/false/no/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _field_type(annotation: Any) -> Any:
    text = str(annotation)
    if "bool" in text:
        return parse_bool
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def check_port(flag: str, port: int) -> None:
    """A TCP port, or 0 for a free one; else ValueError naming the flag."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{flag} must be a TCP port, 0 to 65535 (0: a free one), got {port!r}")


def default_worker_id(kind: str) -> str:
    return f"{kind}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
