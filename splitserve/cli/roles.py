"""`splitserve role` (move one `--role-switch` worker to another role) and `splitserve planner`
(move them to meet an SLO; `splitserve/roles/planner.py`); the call both make is
`splitserve/roles/control.py`'s."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from splitserve.roles.control import KINDS, live_workers, set_role


def _secrets(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str]:
    """(the Redis URL with its password, the cluster secret)."""
    from splitserve.runtime.secrets import read_secret_file, with_redis_password

    if not args.redis_url:
        raise ValueError("--redis-url (or SPLITSERVE_REDIS_URL) is required")
    secret = (
        read_secret_file(args.cluster_secret_file, "cluster secret")
        if args.cluster_secret_file
        else env.get("SPLITSERVE_CLUSTER_SECRET", "")
    )
    password = (
        read_secret_file(args.redis_password_file, "Redis password")
        if args.redis_password_file
        else env.get("REDIS_PASSWORD", "")
    )
    return with_redis_password(args.redis_url, password), secret


def _role(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    redis_url, secret = _secrets(args, env)
    found = [w for w in live_workers(redis_url, secret) if w.worker_id == args.worker]
    if not found:
        print(f"splitserve role: error: no live worker {args.worker!r}", file=sys.stderr)
        return 1
    done = set_role(found[0].address, args.worker, args.to, secret, args.drain_timeout_s)
    print(
        f"{done.worker_id}: {done.previous_kind} -> {done.kind} in {done.seconds:.2f} s "
        f"({done.num_streams_moved} stream(s) moved)"
    )
    return 0


def _common(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    p.add_argument(
        "--redis-url", default=env.get("SPLITSERVE_REDIS_URL"), help="the registry's Redis"
    )
    p.add_argument(
        "--cluster-secret-file",
        default=env.get("SPLITSERVE_CLUSTER_SECRET_FILE"),
        help="the deployment's shared secret (or SPLITSERVE_CLUSTER_SECRET)",
    )
    p.add_argument(
        "--redis-password-file",
        default=env.get("SPLITSERVE_REDIS_PASSWORD_FILE"),
        help="Redis's password (or REDIS_PASSWORD)",
    )


def add_role_commands(sub: Any, env: Mapping[str, str]) -> None:
    """Add `role` and `planner` to the `splitserve` command's subparsers."""
    role = sub.add_parser("role", help="move a --role-switch worker to another role")
    role.add_argument("--worker", required=True, help="the worker's id (as in the registry)")
    role.add_argument("--to", required=True, choices=KINDS, help="the role to take")
    role.add_argument(
        "--drain-timeout-s",
        type=float,
        default=0.0,
        help="let work of the old role finish this long before decode streams move "
        "elsewhere (0: the worker's --drain-timeout-s)",
    )
    _common(role, env)
    role.set_defaults(func=lambda args: _role(args, env))

    from splitserve.roles.planner import add_planner_flags, run_planner

    planner = sub.add_parser(
        "planner", help="move --role-switch workers between roles to meet a TTFT/TPOT SLO"
    )
    _common(planner, env)
    add_planner_flags(planner)
    planner.set_defaults(func=lambda args: run_planner(args, *_secrets(args, env)))
