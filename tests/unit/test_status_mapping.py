"""One interceptor maps errors to status codes on a real gRPC server: domain errors carry their
status and message; any other exception is a bug of ours, answered INTERNAL (and logged), never
blamed on the client."""

from __future__ import annotations

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
    "bug_value": ValueError("int() of a bad internal string"),
    "bug_key": KeyError("some-internal-key"),
    "bug_type": TypeError("unsupported operand"),
}


def _handler(request: bytes, context: grpc.ServicerContext) -> bytes:
    raise RAISES[request.decode()]


@pytest.fixture(scope="module")
def stub():
    def register(server: grpc.Server) -> None:
        rpc = grpc.unary_unary_rpc_method_handler(_handler)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Raise", {"Call": rpc}),)
        )

    server = start_server(register, ["test.Raise"])
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield channel.unary_unary("/test.Raise/Call")
    channel.close()
    server.stop(0)


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT),
        ("not_found", grpc.StatusCode.NOT_FOUND),
        ("stale", grpc.StatusCode.FAILED_PRECONDITION),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("down", grpc.StatusCode.UNAVAILABLE),
        ("late", grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
def test_a_domain_error_reaches_the_client_with_its_status_and_message(stub, kind, code):
    with pytest.raises(grpc.RpcError) as err:
        stub(kind.encode(), timeout=10)
    assert err.value.code() == code
    assert err.value.details() == str(RAISES[kind])


@pytest.mark.parametrize("kind", ["bug_value", "bug_key", "bug_type"])
def test_any_other_exception_is_internal_and_logged(stub, kind, caplog):
    with pytest.raises(grpc.RpcError) as err:
        stub(kind.encode(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert type(RAISES[kind]).__name__ in err.value.details()
    assert any(r.exc_info and r.exc_info[1] is RAISES[kind] for r in caplog.records)
