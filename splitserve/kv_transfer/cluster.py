"""Membership of a deployment: the cluster secret every internal call carries.

Workers and the gateway share one secret (`--cluster-secret-file`, SPLITSERVE_CLUSTER_SECRET).
Every call between them (Reserve, Prefill, Decode, Abort, GetStats, PushBlocks) carries it in
metadata, and every worker-side server checks it before a handler runs: a stranger on the
network who can reach a worker's port cannot reserve blocks, push KV or read a stream.

This module is the part the KV transfer layer needs (the gRPC KV receiver runs a synchronous
server of its own); `runtime/auth.py` builds the asyncio interceptors on the same check.
With no secret configured, nothing is sent and nothing is checked.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

CLUSTER_SECRET_KEY = "x-splitserve-cluster-secret"
"""The metadata key of the cluster secret (lower case, as gRPC requires)."""

Metadata = Mapping[str, Any] | Iterable[tuple[str, Any]] | None


def metadata_value(metadata: Metadata, key: str) -> str | None:
    """The first value of `key` (case-insensitive) in gRPC metadata or HTTP headers."""
    if metadata is None:
        return None
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    key = key.lower()
    for name, value in pairs:
        if str(name).lower() == key:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison; an empty or missing value never matches."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def is_member(metadata: Metadata, secret: str) -> bool:
    """True if the call's metadata carries the cluster `secret` (always, when there is none)."""
    return not secret or same_secret(metadata_value(metadata, CLUSTER_SECRET_KEY), secret)


def secret_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """What a member adds to each internal call (nothing when no secret is configured)."""
    return ((CLUSTER_SECRET_KEY, secret),) if secret else ()


CALLER_KEY = "x-splitserve-caller"
"""The metadata key of the client a member's call is made for (an API key's principal)."""

_MAX_CALLER_CHARS = 64


def caller_metadata(caller: str) -> tuple[tuple[str, str], ...]:
    return ((CALLER_KEY, caller),) if caller else ()


def caller_of(metadata: Metadata) -> str:
    """The client a call is made for ("" when none is named); only members can name one, so
    it is trusted as far as the cluster secret is."""
    return (metadata_value(metadata, CALLER_KEY) or "")[:_MAX_CALLER_CHARS]


NOT_A_MEMBER = "this call needs the deployment's cluster secret (x-splitserve-cluster-secret)"


class MemberOnlyInterceptor(grpc.ServerInterceptor):
    """For synchronous servers (the gRPC KV receiver): refuses a call without the cluster
    secret with UNAUTHENTICATED before its handler sees a byte of the request."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or is_member(details.invocation_metadata, self._secret):
            return handler

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, NOT_A_MEMBER)

        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
