"""`splitserve gateway | prefill | decode`: one service in this process (compose and
Kubernetes run these; `splitserve up` starts each as a child running this), its flags, and how
it starts, drains on a signal and stops."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any


def add_serve_commands(sub: Any, env: Mapping[str, str]) -> None:
    """Add `gateway`, `prefill` and `decode` to the `splitserve` command's subparsers."""
    from splitserve.runtime.security import add_security_flags
    from splitserve.runtime.settings import GatewaySettings, ServiceSettings, add_flags

    for name, help_text in [
        ("gateway", "run the public gateway"),
        ("prefill", "run a prefill worker"),
        ("decode", "run a decode worker"),
    ]:
        p = sub.add_parser(name, help=help_text)
        if name == "gateway":
            add_flags(p, ServiceSettings, env)
            add_flags(p, GatewaySettings, env)
            add_security_flags(p, env, gateway=True)
            # NOTE: set by `--processes N` on each of its processes
            p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
        else:
            add_worker_flags(p, env, name)
        p.set_defaults(func=lambda args: serve(args, env))


def add_worker_flags(parser: argparse.ArgumentParser, env: Mapping[str, str], kind: str) -> None:
    """Every flag of a `kind` (prefill or decode) worker: the one definition of each, which
    `splitserve prefill|decode` take and `splitserve up` mirrors (`up_flags.py`)."""
    from splitserve.runtime.security import add_security_flags
    from splitserve.runtime.settings import ServiceSettings, WorkerSettings, add_flags

    add_flags(parser, ServiceSettings, env)
    add_flags(parser, WorkerSettings, env)
    add_security_flags(parser, env, gateway=False)
    if kind == "decode":
        parser.add_argument("--colocated", action="store_true", help="also prefill (no P workers)")
    parser.add_argument(
        "--role-switch",
        action="store_true",
        help="serve both roles' calls on one engine, so that `splitserve role` (or the "
        "planner) can move this worker between prefill, decode and colocated in place",
    )


def serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """One service until SIGTERM (or Ctrl-C): then drain, stop, and exit 0. A second signal
    cuts the drain short. A signal during start-up stops what started and exits 130."""
    from splitserve.engine.gguf_cache import resolve_checkpoint
    from splitserve.launch.default_model import resolve_model_arg
    from splitserve.runtime.secrets import with_redis_password
    from splitserve.runtime.security import security_from_args
    from splitserve.runtime.settings import (
        GatewaySettings,
        ServiceSettings,
        TracingSettings,
        WorkerSettings,
        default_worker_id,
        from_args,
    )
    from splitserve.runtime.tracing import make_tracing

    kind = "colocated" if getattr(args, "colocated", False) else args.command
    if not args.redis_url:
        raise ValueError("--redis-url (or SPLITSERVE_REDIS_URL) is required")
    service = from_args(
        ServiceSettings,
        args,
        model=str(resolve_checkpoint(resolve_model_arg(args.model))),  # a GGUF: converted once
        worker_id=args.worker_id or default_worker_id(kind),
    )
    security = security_from_args(args, env)
    security.check_exposure(
        service.host, gateway=args.command == "gateway", http=bool(getattr(args, "http_port", 0))
    )
    security.metrics_secret(service.metrics_bind_host, service.metrics_port)  # NOTE: fails early
    if args.command != "gateway":  # NOTE: before NIXL starts here or in the engine core
        from splitserve.kv_transfer.nixl_ucx import bind_ucx_to

        bind_ucx_to(service.host)
    if args.command == "gateway" and not args.reuse_port:
        from splitserve.launch.gateway_processes import default_processes, run_gateway_processes

        processes = args.processes or default_processes()
        if processes > 1:  # NOTE: this process only supervises; each child is a gateway
            return run_gateway_processes(
                args.argv, processes, service.host, service.port, args.http_port,
                service.metrics_port, service.worker_id, args.max_inflight,
                service.drain_timeout_s, metrics_host=service.metrics_bind_host,
            )  # fmt: skip
    from splitserve.runtime.torchless import keep_torch_out

    # NOTE: before the service's modules load transformers: a gateway and a worker's front
    # need no torch (a worker's engine core, a process of its own, loads it)
    keep_torch_out()

    # NOTE: the password joins the URL in memory only (never argv, never printed).
    service = dataclasses.replace(
        service, redis_url=with_redis_password(service.redis_url, security.redis_password)
    )
    tracing = make_tracing(TracingSettings.from_env(env), kind, service.worker_id)
    stop, hurry = threading.Event(), threading.Event()
    starting = [True]

    def on_signal(*_: object) -> None:
        if starting[0]:
            raise KeyboardInterrupt  # NOTE: start_* undo what they started, then re-raise
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        if args.command == "gateway":
            gateway = from_args(GatewaySettings, args)
            if args.reuse_port:  # one of `--processes N`: it stops when its parent goes
                threading.Thread(target=_stop_with_parent, daemon=True).start()
            from splitserve.launch.gateway_service import start_gateway

            running = start_gateway(service, gateway, tracing, security, reuse_port=args.reuse_port)
        elif args.role_switch:  # NOTE: its role can change later (`splitserve role`)
            from splitserve.roles.switchable import start_switchable

            worker = from_args(WorkerSettings, args)
            running = start_switchable(service, worker, kind, tracing, security, _core_died)
        elif args.command == "prefill":
            from splitserve.launch.services import start_prefill

            worker = from_args(WorkerSettings, args)
            running = start_prefill(service, worker, tracing, security, _core_died)
        else:
            from splitserve.launch.services import start_decode

            worker = from_args(WorkerSettings, args)
            running = start_decode(service, worker, kind, tracing, security, _core_died)
        starting[0] = False
        print(f"{kind} {service.worker_id} serving on {running.address}", flush=True)
        if running.http_port:
            print(f"{kind} OpenAI-compatible HTTP API on port {running.http_port}", flush=True)
        stop.wait()
        print(f"{kind} {service.worker_id} draining", flush=True)
        drained = running.drain(service.drain_timeout_s, hurry)
        running.stop()
        print(f"{kind} {service.worker_id} stopped ({'drained' if drained else 'cut short'})")
    finally:
        tracing.shutdown()
    return 0


def _stop_with_parent() -> None:
    """SIGTERM ourselves once stdin closes: the supervising parent went away."""
    sys.stdin.read()
    os.kill(os.getpid(), signal.SIGTERM)


def _core_died(exc: BaseException) -> None:
    """A worker whose engine core process died is dead as a whole, as if its one process had
    died: no drain, no goodbye (its leases lapse; the gateway moves its streams)."""
    print(f"the engine core died ({exc}); the worker exits", file=sys.stderr, flush=True)
    os._exit(70)
