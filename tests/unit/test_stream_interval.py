"""The gateway's token coalescing (`stream_interval`) and the sizing rules of `--processes`."""

from __future__ import annotations

import socket

import pytest

from splitserve.engine.errors import InvalidRequest
from splitserve.gateway.coalesce import Coalescer, check_stream_interval, check_stream_interval_ms
from splitserve.launch.gateway_processes import default_processes, hold_port, inflight_share
from splitserve.protos.v1 import common_pb2
from splitserve.runtime.grpc_server import BindError


def _delta(index: int, ids: list[int], text: str = "") -> common_pb2.SampleDelta:
    return common_pb2.SampleDelta(index=index, token_ids=ids, text=text or "".join(map(str, ids)))


def test_interval_one_passes_each_chunk_through_uncopied():
    coalescer = Coalescer(1)
    chunk = _delta(0, [1])
    assert coalescer.add(chunk) is chunk
    assert coalescer.flush() == []


def test_tokens_are_held_until_a_sample_has_the_interval_then_sent_as_one_chunk():
    coalescer = Coalescer(3)
    assert coalescer.add(_delta(0, [1])) is None
    assert coalescer.add(_delta(1, [9])) is None
    assert coalescer.add(_delta(0, [2])) is None
    out = coalescer.add(_delta(0, [3, 4]))
    assert out is not None and list(out.token_ids) == [1, 2, 3, 4] and out.text == "1234"
    assert out.index == 0
    (rest,) = coalescer.flush()  # sample 1's token is not lost at the end
    assert rest.index == 1 and list(rest.token_ids) == [9]
    assert coalescer.flush() == []


def test_a_chunk_already_as_large_as_the_interval_goes_through_as_it_is():
    coalescer = Coalescer(2)
    chunk = _delta(0, [1, 2, 3])
    assert coalescer.add(chunk) is chunk


def test_logprobs_follow_their_tokens():
    coalescer = Coalescer(2)
    first, second = _delta(0, [1]), _delta(0, [2])
    first.logprobs.add(token_id=1, logprob=-0.5)
    second.logprobs.add(token_id=2, logprob=-1.5)
    coalescer.add(first)
    out = coalescer.add(second)
    assert out is not None and [lp.token_id for lp in out.logprobs] == [1, 2]


@pytest.mark.parametrize("bad", [0, 5000])
def test_an_interval_out_of_range_is_an_invalid_request(bad):
    with pytest.raises(InvalidRequest, match="stream_interval"):
        check_stream_interval(bad)


@pytest.mark.parametrize("bad", [-1, 10_001])
def test_a_time_interval_out_of_range_is_an_invalid_request(bad):
    with pytest.raises(InvalidRequest, match="stream_interval_ms must be 0 to 10000 ms"):
        check_stream_interval_ms(bad)
    assert check_stream_interval_ms(0) == 0 and check_stream_interval_ms(10_000) == 10_000


def test_default_process_count_is_a_quarter_of_the_cores_from_one_to_eight():
    assert [default_processes(c) for c in (1, 2, 4, 8, 16, 64, 256)] == [1, 1, 1, 2, 4, 8, 8]


def test_each_process_gets_its_share_of_the_inflight_limit_rounded_up():
    assert inflight_share(256, 3) == 86
    assert inflight_share(1, 4) == 1


def test_a_port_someone_else_holds_is_refused_before_any_process_starts():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(BindError, match="in use|another server"):
            hold_port("127.0.0.1", port, "--port")


def test_a_held_port_keeps_a_second_gateway_group_out():
    held = hold_port("127.0.0.1", 0, "--port")
    try:
        port = held.getsockname()[1]
        with pytest.raises(BindError):
            hold_port("127.0.0.1", port, "--port")
    finally:
        held.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream_interval", 0),
        ("stream_interval_ms", -1),
        ("stream_interval_ms", 10_001),
        ("processes", -1),
    ],
)
def test_gateway_flags_out_of_range_name_the_flag(field, value):
    from splitserve.runtime.settings import GatewaySettings

    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')}"):
        GatewaySettings(**{field: value})
