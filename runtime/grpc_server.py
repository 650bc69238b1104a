"""What every splitserve gRPC server shares: health, reflection, and one interceptor that maps
exceptions to status codes, so servicers stay thin (protobuf -> domain -> engine -> protobuf)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.engine.errors import SplitserveError

log = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client should see for `exc`.

    Domain errors (`engine.errors`) carry their status; a worker's status met on a call the
    handler made (a `grpc.RpcError`) is passed on as it came. Anything else is a bug here, not
    the caller's fault: INTERNAL.
    """
    if isinstance(exc, SplitserveError):
        return grpc.StatusCode[exc.status], str(exc)
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return exc.code(), exc.details() or str(exc)  # type: ignore[attr-defined]
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


class StatusInterceptor(grpc.ServerInterceptor):
    """Turns any exception a handler raises into `context.abort(code, message)`."""

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary))
        return handler


def _is_abort(exc: Exception) -> bool:
    # NOTE: context.abort() ends a handler by raising a bare Exception; let it through.
    return type(exc) is Exception


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("handler failed", exc_info=exc)
    context.abort(code, message)


def _wrap_unary(fn: Callable) -> Callable:
    def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(request, context)
        except Exception as exc:
            if _is_abort(exc):
                raise
            _abort(context, exc)

    return wrapper


def _wrap_stream(fn: Callable) -> Callable:
    def wrapper(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(request, context)
        except Exception as exc:
            if _is_abort(exc):
                raise
            _abort(context, exc)

    return wrapper


@dataclass
class Server:
    """A started server: its bound port and the health servicer to flip."""

    server: grpc.Server
    port: int
    health: health.HealthServicer

    def set_serving(self, serving: bool, services: Iterable[str] = ("",)) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in services:
            self.health.set(name, status)

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 64,
) -> Server:
    """Start a server with health (NOT_SERVING until `set_serving`) and reflection.

    Port 0 picks a free port; the bound one is returned.
    """
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[StatusInterceptor()],
        options=[
            ("grpc.max_receive_message_length", 8 * 1024 * 1024),
            ("grpc.max_send_message_length", 8 * 1024 * 1024),
        ],
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    server.start()
    result = Server(server, bound, health_servicer)
    result.set_serving(False, ["", *service_names])
    return result
