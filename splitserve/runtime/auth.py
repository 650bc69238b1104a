"""Who may call what: API keys at the gateway, the cluster secret between members, TLS.

    client ──authorization: Bearer <key>──▶ gateway   (`ApiKeys.authorize`; TLS optional)
    gateway / prefill ──x-splitserve-cluster-secret──▶ workers, KV receivers (`is_member`)

One server interceptor (`AuthInterceptor`) runs the check of its server before any handler;
a call that fails it gets UNAUTHENTICATED. Health and reflection stay open (load balancers and
orchestrators probe them). The caller's identity (its *principal*: a digest of its key, never the
key) is available to handlers as `caller()`, so that a request belongs to the key that made it.

`authorize(metadata_or_headers, api_keys)` is the same check for any front door (the HTTP API
passes its request headers); run the handler under `acting_as(principal)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import inspect
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.engine.errors import SplitserveError
from splitserve.kv_transfer.cluster import (
    NOT_A_MEMBER,
    Metadata,
    caller_metadata,
    is_member,
    metadata_value,
    secret_metadata,
)

AUTHORIZATION_KEY = "authorization"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods any caller may use: health checks and reflection."""
ANONYMOUS = ""
MEMBER = "cluster-member"

_PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar(
    "splitserve_principal", default=ANONYMOUS
)


class Unauthenticated(SplitserveError):
    """The caller did not prove who it is (no key, a wrong key, no cluster secret)."""

    status = "UNAUTHENTICATED"


def principal_of(key: str) -> str:
    """The name a key acts under: a short digest, so that logs and tables never hold keys."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ApiKeys:
    """The API keys a gateway accepts; none: every caller is the anonymous principal."""

    keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for key in self.keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty and contain no whitespace")

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def authorize(self, metadata: Metadata) -> str:
        """The caller's principal, from `authorization: Bearer <key>`; Unauthenticated when
        keys are configured and the call carries none of them."""
        if not self.keys:
            return ANONYMOUS
        value = metadata_value(metadata, AUTHORIZATION_KEY)
        if value is None:
            raise Unauthenticated("this gateway needs an API key: authorization: Bearer <key>")
        scheme, _, given = value.strip().partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            raise Unauthenticated("the authorization header must be 'Bearer <key>'")
        found = None
        for key in self.keys:  # NOTE: every key compared, in constant time each
            if hmac.compare_digest(given.encode(), key.encode()):
                found = key
        if found is None:
            raise Unauthenticated("the API key is not valid")
        return principal_of(found)


def authorize(metadata_or_headers: Metadata, api_keys: ApiKeys) -> str:
    """The caller's principal, or Unauthenticated (UNAUTHENTICATED / HTTP 401)."""
    return api_keys.authorize(metadata_or_headers)


def caller() -> str:
    """The principal of the call being handled (ANONYMOUS when no keys are configured)."""
    return _PRINCIPAL.get()


@contextlib.contextmanager
def acting_as(principal: str) -> Iterator[None]:
    """Run a handler as `principal` (front doors other than gRPC)."""
    token = _PRINCIPAL.set(principal)
    try:
        yield
    finally:
        _PRINCIPAL.reset(token)


def member_check(secret: str) -> Callable[[Metadata], str]:
    """The check of a worker's server: the call carries the cluster secret."""

    def check(metadata: Metadata) -> str:
        if not is_member(metadata, secret):
            raise Unauthenticated(NOT_A_MEMBER)
        return MEMBER

    return check


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Runs `check(invocation_metadata) -> principal` before every handler but the open ones;
    a failed check answers UNAUTHENTICATED (through the status interceptor, which must wrap
    this one), a passed one runs the handler with `caller()` set."""

    def __init__(self, check: Callable[[Metadata], str]) -> None:
        self._check = check

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        try:
            principal = self._check(details.invocation_metadata)
        except Unauthenticated as exc:
            return _replace(handler, _denied(exc))
        return _replace(handler, lambda fn: _as_principal(fn, principal))


def _replace(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable]) -> Any:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        fn = getattr(handler, kind)
        if fn is not None:
            return handler._replace(**{kind: wrap(fn)})  # type: ignore[attr-defined]
    return handler


def _denied(exc: Unauthenticated) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            raise exc

        return deny

    return wrap


def _as_principal(fn: Callable, principal: str) -> Callable:
    # NOTE: a plain function that returns what the handler returns (a coroutine, an async
    # generator): the status interceptor awaits or iterates it in the call's task, whose
    # context now holds the principal.
    def wrapper(request: Any, context: Any) -> Any:
        _PRINCIPAL.set(principal)
        return fn(request, context)

    if inspect.iscoroutinefunction(fn):

        async def async_wrapper(request: Any, context: Any) -> Any:
            _PRINCIPAL.set(principal)
            return await fn(request, context)

        return async_wrapper
    return wrapper


class _AddMetadata:
    """Adds fixed metadata (the cluster secret) to every call of an aio channel and, with
    `forward_caller`, the principal the call is made for (`caller()`, when not anonymous).

    NOTE: grpc.aio files an interceptor under the first call type it implements only, so
    each call type gets an instance of its own (`member_channel_interceptors`)."""

    def __init__(self, extra: Sequence[tuple[str, str]], forward_caller: bool = False) -> None:
        self._extra = tuple(extra)
        self._forward_caller = forward_caller

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        extra = self._extra
        if self._forward_caller and caller():
            extra = (*extra, *caller_metadata(caller()))
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ())), *extra)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )  # fmt: skip


class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def member_channel_interceptors(secret: str, forward_caller: bool = False) -> list[Any]:
    """Interceptors for aio channels to other members: the cluster secret on every call and,
    with `forward_caller` (the gateway's channels), the client each call is made for, which
    decode workers count reservations against. None when there is nothing to add."""
    if not secret and not forward_caller:
        return []
    extra = secret_metadata(secret)
    return [
        cls(extra, forward_caller)
        for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    ]
