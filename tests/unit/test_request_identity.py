"""Request identity in the gateway (one claim per running id, Aborts remembered for requests on
their way), the bounds on a request checked before tokenizing, and bounded error text."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.errors import AlreadyExists, InvalidRequest, clip, quoted
from splitserve.gateway.limits import RequestLimits, check_request
from splitserve.gateway.requests import RequestTable
from splitserve.protos.v1 import common_pb2, gateway_pb2


def test_a_running_id_is_claimed_once_and_only_its_claim_releases_it():
    async def go() -> None:
        table = RequestTable()
        first = table.claim("x")
        with pytest.raises(AlreadyExists, match="already running"):
            table.claim("x")
        stranger = type(first)("x")  # a claim that does not hold the id
        table.release(stranger)
        assert len(table) == 1 and not first.aborted
        table.release(first)
        assert len(table) == 0
        table.claim("x")  # free again

    asyncio.run(go())


def test_abort_before_the_claim_is_remembered_but_not_after_the_request_ended():
    async def go() -> None:
        table = RequestTable(remember_s=60)
        assert table.abort("early") is False
        assert table.claim("early").aborted
        done = table.claim("done")
        table.release(done)
        assert table.abort("done") is False
        assert not table.claim("done").aborted

    asyncio.run(go())


def test_abort_cancels_the_task_only_while_it_waits_on_the_workers():
    async def go() -> None:
        table = RequestTable()
        claim = table.claim("r")
        assert table.abort("r") and claim.aborted  # not waiting: only marked
        assert not claim.absorb_cancel()

        async def waiter() -> str:
            inner = table.claim("w")
            inner.waiting = True
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return "absorbed" if inner.absorb_cancel() else "cancelled"
            return "slept"

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        assert table.abort("w")
        assert await task == "absorbed"
        finished = table.claim("f")
        finished.finished = True
        assert table.abort("f") is False

    asyncio.run(go())


def _request(**fields) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        stop=fields.pop("stop", []), stop_token_ids=fields.pop("stop_token_ids", [])
    )
    if "n" in fields:
        sampling.n = fields.pop("n")
    request = gateway_pb2.GenerateRequest(sampling=sampling, **fields)
    request.token_ids.ids.extend(fields.get("ids", [5, 6]))
    return request


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"request_id": "i" * 1_000_000}, "request_id has 1000000 characters"),
        ({"request_id": "a\r\nERROR forged"}, "printable ASCII"),
        ({"stop": ["x" * 100_000]}, r"stop\[0\] has 100000 characters"),
        ({"stop": ["s"] * 17}, "stop has 17 strings"),
        ({"stop_token_ids": list(range(1000))}, "stop_token_ids has 1000 ids"),
        ({"n": 2**32 - 1}, "at most 8 samples"),
    ],
)
def test_requests_outside_the_bounds_are_refused_briefly(fields, message):
    limits = RequestLimits(worker_max_num_seqs=8, worker_max_model_len=64)
    with pytest.raises(InvalidRequest, match=message) as err:
        check_request(_request(**fields), limits)
    assert len(str(err.value).encode()) < 300 and "\n" not in str(err.value)


def test_a_prompt_longer_than_the_workers_context_is_refused_before_tokenizing():
    request = _request()
    request.token_ids.ids.extend([7] * 100)
    with pytest.raises(InvalidRequest, match="workers' context is 64"):
        check_request(request, RequestLimits(worker_max_model_len=64))
    check_request(_request(request_id="ok-1", n=8), RequestLimits(worker_max_num_seqs=8))


def test_messages_are_clipped_and_quoted_values_escaped_and_bounded():
    assert clip("short") == "short"
    long = clip("é" * 5000)
    assert len(long.encode()) <= 1000 and long.endswith("…")
    assert quoted("a\r\nb") == "'a\\r\\nb'"
    assert quoted("z" * 10_000, 10) == "'zzzzzzzzzz'… (10000 characters)"


def test_two_keys_run_the_same_id_side_by_side_and_abort_only_their_own():
    async def go() -> None:
        table = RequestTable()
        alice = table.claim("same", owner="key-alice")
        mallory = table.claim("same", owner="key-mallory")  # no ALREADY_EXISTS: not alice's
        with pytest.raises(AlreadyExists):
            table.claim("same", owner="key-alice")
        assert table.holds("same", "key-alice") and not table.holds("same", "key-bob")
        assert sorted(table.ids()) == [("key-alice", "same"), ("key-mallory", "same")]
        assert table.abort("same", owner="key-mallory") and mallory.aborted
        assert not alice.aborted
        table.release(mallory)
        assert table.holds("same", "key-alice") and len(table) == 1

    asyncio.run(go())
