"""A service's security settings: API keys and TLS (gateway), the cluster secret (every
member), the Redis password; read from files and the environment (`runtime/secrets.py`), never
taken from argv except `--api-key`, which is for trying things out.

A service refuses to listen on an address other than loopback without protection (the gateway
without an API key, a worker without the cluster secret) unless it is given `--insecure`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.runtime.auth import ApiKeys, AuthInterceptor, acting_as, member_check
from splitserve.runtime.secrets import read_lines_file, read_secret_file, split_list
from splitserve.runtime.settings import parse_bool


@dataclass(frozen=True)
class Security:
    """What a service checks and carries. Secrets never appear in its repr."""

    api_keys: ApiKeys = ApiKeys()
    cluster_secret: str = field(default="", repr=False)
    redis_password: str = field(default="", repr=False)
    tls_cert_chain: bytes | None = field(default=None, repr=False)
    tls_private_key: bytes | None = field(default=None, repr=False)
    insecure: bool = False

    def __post_init__(self) -> None:
        if (self.tls_cert_chain is None) != (self.tls_private_key is None):
            raise ValueError("TLS needs both --tls-cert-file and --tls-key-file")

    @property
    def tls(self) -> bool:
        return self.tls_cert_chain is not None

    def secrets(self) -> tuple[str, ...]:
        """Every secret value held (to mask in anything printed)."""
        return (*self.api_keys.keys, self.cluster_secret, self.redis_password)

    def gateway_interceptors(self) -> list[Any]:
        return [AuthInterceptor(self.api_keys.authorize)] if self.api_keys.required else []

    def worker_interceptors(self) -> list[Any]:
        return [AuthInterceptor(member_check(self.cluster_secret))] if self.cluster_secret else []

    def http_authorize(self) -> Callable[[Mapping[str, str]], AbstractContextManager[None]] | None:
        """The HTTP front door's check (its `authorize` hook): the same keys, the caller's
        principal set while its request is served; None when no keys are configured."""
        if not self.api_keys.required:
            return None
        keys = self.api_keys
        return lambda headers: acting_as(keys.authorize(headers))

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert_chain is None or self.tls_private_key is None:
            return None
        return grpc.ssl_server_credentials([(self.tls_private_key, self.tls_cert_chain)])

    def http_ssl_context(self) -> ssl.SSLContext | None:
        """The HTTP API's TLS (the same certificate as the gRPC port's); None without TLS."""
        if self.tls_cert_chain is None or self.tls_private_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        # NOTE: `ssl` loads a chain from files only: a private directory, gone once loaded.
        with tempfile.TemporaryDirectory(prefix="splitserve-tls-") as directory:
            chain, key = os.path.join(directory, "chain.pem"), os.path.join(directory, "key.pem")
            for path, data in ((chain, self.tls_cert_chain), (key, self.tls_private_key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
            context.load_cert_chain(chain, key)
        return context

    def check_exposure(self, host: str, gateway: bool, http: bool = False) -> None:
        """Refuse to serve on a non-loopback `host` without protection (unless --insecure);
        `http`: the gateway serves the HTTP API too, which then needs TLS."""
        if self.insecure or is_loopback(host):
            return
        if gateway:
            if not self.api_keys.required:
                raise ValueError(
                    f"the gateway would serve {host} to anyone: give it --api-key-file (or "
                    "SPLITSERVE_API_KEYS), and --tls-cert-file/--tls-key-file, or --insecure "
                    "to serve without them"
                )
            if http and not self.tls:
                raise ValueError(
                    f"the HTTP API would carry API keys and prompts in clear on {host}: give "
                    "the gateway --tls-cert-file/--tls-key-file, or --insecure to serve it "
                    "without TLS"
                )
        elif not self.cluster_secret:
            raise ValueError(
                f"this service would take internal calls on {host} from anyone: give every "
                "service the same --cluster-secret-file (or SPLITSERVE_CLUSTER_SECRET), or "
                "--insecure to serve without it"
            )

    def metrics_secret(self, host: str, port: int = 1) -> str:
        """The bearer token /metrics asks for when it listens on `host`:`port`: none on
        loopback (or with port 0: it does not listen), the cluster secret elsewhere (what it
        shows, load, request counts, worker names, is for the operator). Raises ValueError off
        loopback without a cluster secret, unless --insecure."""
        if not port or is_loopback(host) or (self.insecure and not self.cluster_secret):
            return ""
        if not self.cluster_secret:
            raise ValueError(
                f"/metrics would answer anyone on {host}: give the service --cluster-secret-file "
                "(or SPLITSERVE_CLUSTER_SECRET; scrapers send it as a bearer token), "
                "--metrics-host 127.0.0.1, or --insecure"
            )
        return self.cluster_secret


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_security_flags(
    parser: argparse.ArgumentParser, env: Mapping[str, str], gateway: bool
) -> None:
    """The flags of a service; each secret's file may also be named by its SPLITSERVE_*_FILE
    variable, or the secret itself given in the environment."""
    parser.add_argument(
        "--cluster-secret-file",
        default=env.get("SPLITSERVE_CLUSTER_SECRET_FILE"),
        help="the deployment's shared secret, sent on and required of every internal call "
        "(or SPLITSERVE_CLUSTER_SECRET)",
    )
    parser.add_argument(
        "--redis-password-file",
        default=env.get("SPLITSERVE_REDIS_PASSWORD_FILE"),
        help="Redis's password (or REDIS_PASSWORD)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=parse_bool(env.get("SPLITSERVE_INSECURE", "0")),
        help="serve a non-loopback address without API keys / cluster secret",
    )
    if not gateway:
        return
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept this API key (repeatable; visible in the process list: prefer "
        "--api-key-file or SPLITSERVE_API_KEYS)",
    )
    parser.add_argument(
        "--api-key-file",
        default=env.get("SPLITSERVE_API_KEY_FILE"),
        help="accept the API keys in this file, one per line",
    )
    parser.add_argument(
        "--tls-cert-file",
        default=env.get("SPLITSERVE_TLS_CERT_FILE"),
        help="serve TLS with this certificate (PEM)",
    )
    parser.add_argument(
        "--tls-key-file",
        default=env.get("SPLITSERVE_TLS_KEY_FILE"),
        help="… and this private key (PEM)",
    )


def security_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> Security:
    cluster_secret = (
        read_secret_file(args.cluster_secret_file, "cluster secret")
        if args.cluster_secret_file
        else env.get("SPLITSERVE_CLUSTER_SECRET", "")
    )
    redis_password = (
        read_secret_file(args.redis_password_file, "Redis password")
        if args.redis_password_file
        else env.get("REDIS_PASSWORD", "")
    )
    keys = list(getattr(args, "api_key", None) or ())
    if getattr(args, "api_key_file", None):
        keys += read_lines_file(args.api_key_file, "API key")
    keys += split_list(env.get("SPLITSERVE_API_KEY")) + split_list(env.get("SPLITSERVE_API_KEYS"))
    cert_file, key_file = getattr(args, "tls_cert_file", None), getattr(args, "tls_key_file", None)
    return Security(
        api_keys=ApiKeys(tuple(dict.fromkeys(keys))),
        cluster_secret=cluster_secret,
        redis_password=redis_password,
        tls_cert_chain=_read_bytes(cert_file, "TLS certificate") if cert_file else None,
        tls_private_key=_read_bytes(key_file, "TLS key") if key_file else None,
        insecure=args.insecure,
    )


def _read_bytes(path: str, what: str) -> bytes:
    return read_secret_file(path, what).encode() + b"\n"
