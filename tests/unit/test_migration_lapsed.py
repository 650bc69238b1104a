"""Which failed Decode calls the gateway moves: a lost worker's, and one whose reservation
lapsed before it came (NOT_FOUND before any message); never a request's own error."""

from __future__ import annotations

import grpc
import pytest

from splitserve.gateway.migration import is_reservation_lapsed, is_worker_lost
from splitserve.gateway.stream_watch import WorkerLost


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


def test_not_found_before_any_message_is_a_lapsed_reservation() -> None:
    assert is_reservation_lapsed(_error(grpc.StatusCode.NOT_FOUND), 0)
    assert not is_worker_lost(_error(grpc.StatusCode.NOT_FOUND))


@pytest.mark.parametrize(
    ("code", "num_messages"),
    [
        (grpc.StatusCode.NOT_FOUND, 1),  # tokens went out: it was admitted, not lapsed
        (grpc.StatusCode.INVALID_ARGUMENT, 0),
        (grpc.StatusCode.FAILED_PRECONDITION, 0),
        (grpc.StatusCode.UNAVAILABLE, 0),  # a lost worker: moved for that reason instead
    ],
)
def test_other_failures_are_not_a_lapsed_reservation(code, num_messages) -> None:
    assert not is_reservation_lapsed(_error(code), num_messages)


def test_a_stalled_stream_is_a_lost_worker_not_a_lapse() -> None:
    assert is_worker_lost(WorkerLost("stalled"))
    assert not is_reservation_lapsed(WorkerLost("stalled"), 0)
