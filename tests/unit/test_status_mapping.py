"""One interceptor maps errors to status codes on a real (asyncio) gRPC server, for unary,
server-streaming and client-streaming handlers alike: domain errors carry their status and
message; a worker's status met on a downstream call is passed on as it came; any other exception
is a bug of ours, answered INTERNAL (and logged), never blamed on the client; a client that
cancels its call is no internal error."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest

from splitserve.engine.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    Overloaded,
    Unavailable,
)
from splitserve.runtime.grpc_server import start_server

RAISES = {
    "invalid": InvalidRequest("temperature must be >= 0, got -1.0"),
    "not_found": NotFound("no reservation for request 'r1'"),
    "stale": FailedPrecondition("stale fencing token 3"),
    "full": Overloaded("the gateway is at its limit of 2 requests in flight"),
    "down": Unavailable("draining"),
    "late": DeadlineExceeded("the request's deadline passed"),
    "echo": InvalidRequest("stop must not be " + "x" * 100_000),  # echoes a 100 KB input
    "bug_value": ValueError("int() of a bad internal string"),
    "bug_key": KeyError("some-internal-key"),
    "bug_type": TypeError("unsupported operand"),
}
DOMAIN = [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT),
    ("not_found", grpc.StatusCode.NOT_FOUND),
    ("stale", grpc.StatusCode.FAILED_PRECONDITION),
    ("full", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("down", grpc.StatusCode.UNAVAILABLE),
    ("late", grpc.StatusCode.DEADLINE_EXCEEDED),
]
BUGS = ["bug_value", "bug_key", "bug_type"]
KINDS = ["unary", "stream", "client_stream"]


class Handlers:
    """A coroutine, an async generator and a client-streaming coroutine that raise on demand;
    `Downstream` raises the status of a call to another (real) server; `Wait` waits until the
    client cancels it."""

    def __init__(self) -> None:
        self.downstream_address = ""
        self.waiting = threading.Event()
        self.cancelled = threading.Event()

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RAISES[request.decode()]

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext):
        yield b"first"
        raise RAISES[request.decode()]

    async def client_stream(self, requests, context: grpc.aio.ServicerContext) -> bytes:
        async for request in requests:
            raise RAISES[request.decode()]
        return b"no requests"

    async def downstream(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with grpc.aio.insecure_channel(self.downstream_address) as channel:
            return await channel.unary_unary("/test.Raise/Unary")(request, timeout=10)

    async def wait(self, request: bytes, context: grpc.aio.ServicerContext):
        yield b"waiting"
        self.waiting.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture(scope="module")
def served():
    handlers = Handlers()

    def register(server: grpc.aio.Server) -> None:
        methods = {
            "Unary": grpc.unary_unary_rpc_method_handler(handlers.unary),
            "Stream": grpc.unary_stream_rpc_method_handler(handlers.stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(handlers.client_stream),
            "Downstream": grpc.unary_unary_rpc_method_handler(handlers.downstream),
            "Wait": grpc.unary_stream_rpc_method_handler(handlers.wait),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Raise", methods),)
        )

    server = start_server(register, ["test.Raise"])
    handlers.downstream_address = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield channel, handlers
    channel.close()
    server.stop(0)


def call(channel: grpc.Channel, kind: str, payload: bytes) -> None:
    if kind == "unary":
        channel.unary_unary("/test.Raise/Unary")(payload, timeout=10)
    elif kind == "stream":
        replies = channel.unary_stream("/test.Raise/Stream")(payload, timeout=10)
        assert next(replies) == b"first"
        list(replies)
    else:
        channel.stream_unary("/test.Raise/ClientStream")(iter([payload]), timeout=10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("error", "code"), DOMAIN)
def test_a_domain_error_reaches_the_client_with_its_status_and_message(served, kind, error, code):
    channel, _ = served
    with pytest.raises(grpc.RpcError) as err:
        call(channel, kind, error.encode())
    assert err.value.code() == code
    assert err.value.details() == str(RAISES[error])


@pytest.mark.parametrize("kind", KINDS)
def test_a_message_that_echoes_huge_input_reaches_the_client_clipped(served, kind):
    channel, _ = served
    with pytest.raises(grpc.RpcError) as err:
        call(channel, kind, b"echo")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED
    details = err.value.details()
    assert details.startswith("stop must not be xxx") and details.endswith("…")
    assert len(details.encode()) < 1024


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("error", BUGS)
def test_any_other_exception_is_internal_and_logged(served, kind, error, caplog):
    channel, _ = served
    with pytest.raises(grpc.RpcError) as err:
        call(channel, kind, error.encode())
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert type(RAISES[error]).__name__ in err.value.details()
    assert any(r.exc_info and r.exc_info[1] is RAISES[error] for r in caplog.records)


@pytest.mark.parametrize(("error", "code"), [*DOMAIN[:2], ("bug_key", grpc.StatusCode.INTERNAL)])
def test_a_downstream_calls_status_is_passed_on_as_it_came(served, error, code, caplog):
    channel, _ = served
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/test.Raise/Downstream")(error.encode(), timeout=10)
    assert err.value.code() == code
    if code is grpc.StatusCode.INTERNAL:
        assert "KeyError" in err.value.details()
    else:
        assert err.value.details() == str(RAISES[error])


def test_a_client_cancel_ends_the_handler_and_is_not_logged_as_an_error(served, caplog):
    channel, handlers = served
    caplog.set_level(logging.DEBUG)
    replies = channel.unary_stream("/test.Raise/Wait")(b"", timeout=30)
    assert next(replies) == b"waiting"
    assert handlers.waiting.wait(10)
    replies.cancel()
    assert handlers.cancelled.wait(10), "the handler was not cancelled"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
