"""KV blocks over real NIXL (UCX, DRAM to DRAM) between this process and a receiver process.

The receiver runs in a spawned process with its own pool and a recording `Landing`; the test
drives it over a pipe (reserve, read its pool, read what landed) and pushes from a `NixlSender`
here: bit-exact landing, concurrent pushes, refusals, a killed peer, a timeout, a block-size
mismatch.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from splitserve.kv_transfer.nixl_transport import NixlSender
from splitserve.kv_transfer.transport import Push, TransferError
from tests.e2e.nixl_peer import (
    BLOCK_BYTES,
    DTYPES,
    NUM_BLOCKS,
    TIMEOUT_S,
    RemoteReceiver,
    as_bytes,
    make_connector,
    make_pool,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def receivers() -> Iterator[dict[str, RemoteReceiver]]:
    """One receiver process per dtype, started on first use; each test starts from a reset."""
    started: dict[str, RemoteReceiver] = {}

    class Lazy(dict[str, RemoteReceiver]):
        def __missing__(self, dtype_name: str) -> RemoteReceiver:
            started[dtype_name] = self[dtype_name] = RemoteReceiver(dtype_name)
            return started[dtype_name]

    try:
        yield Lazy()
    finally:
        for remote in started.values():
            remote.close()


@pytest.fixture
def float32(receivers: dict[str, RemoteReceiver]) -> RemoteReceiver:
    remote = receivers["float32"]
    remote.call("reset")
    return remote


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_shuffled_blocks_land_bit_exact(
    receivers: dict[str, RemoteReceiver], dtype_name: str
) -> None:
    remote = receivers[dtype_name]
    remote.call("reset")
    rng = random.Random(1234)
    src_pool = make_pool(DTYPES[dtype_name], seed=7)
    sender = NixlSender(make_connector(src_pool), "prefill-0")
    try:
        src = rng.sample(range(NUM_BLOCKS), 12)  # non-contiguous, shuffled
        dst = rng.sample(range(NUM_BLOCKS), 12)
        remote.call("reserve", "req-a", 3, dst)
        block_bytes = src_pool[0].numel() * src_pool.element_size()
        for i in range(0, 12, 4):
            push = Push("req-a", 3, tuple(src[i : i + 4]), tuple(dst[i : i + 4]), 16 * (i + 4))
            result = sender.push(remote.peer, push, TIMEOUT_S)
            assert (result.num_blocks, result.num_bytes) == (4, 4 * block_bytes)

        # No blocks left to write: the notification alone reports the prompt complete.
        assert sender.push(remote.peer, Push("req-a", 3, (), (), 200), TIMEOUT_S).num_bytes == 0

        events = remote.wait_events(4)
        assert events == [
            *(("landed", "req-a", 3, dst[i : i + 4], 4 * block_bytes) for i in range(0, 12, 4)),
            ("landed", "req-a", 3, [], 0),
        ]
        landed = remote.pool()
        assert torch.equal(as_bytes(landed[dst]), as_bytes(src_pool[src]))
        untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
        assert not as_bytes(landed[untouched]).any(), "a block outside the push was written"
    finally:
        sender.close()
        sender.close()  # idempotent


def test_concurrent_pushes_from_many_threads(float32: RemoteReceiver) -> None:
    src_pool = make_pool(torch.float32, seed=11)
    sender = NixlSender(make_connector(src_pool), "prefill-0")
    try:
        dst = list(range(NUM_BLOCKS))
        random.Random(5).shuffle(dst)
        float32.call("reserve", "req-c", 1, dst)
        errors: list[BaseException] = []

        def push(k: int) -> None:
            try:
                for j in range(k * 8, k * 8 + 8, 2):
                    sender.push(float32.peer, Push("req-c", 1, (j, j + 1), tuple(dst[j : j + 2]),
                                                   0), TIMEOUT_S)  # fmt: skip
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=push, args=(k,)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert not errors
        assert len(float32.wait_events(32)) == 32
        assert torch.equal(as_bytes(float32.pool()[dst]), as_bytes(src_pool))
    finally:
        sender.close()


def test_stale_fence_unknown_request_and_foreign_blocks_are_refused(
    float32: RemoteReceiver,
) -> None:
    sender = NixlSender(make_connector(make_pool(torch.float32, seed=3)), "prefill-0")
    try:
        before = float32.call("stats")  # the receiver's counters span the module's tests
        float32.call("reserve", "req-b", 5, [10, 11])
        sender.push(float32.peer, Push("req-b", 4, (0,), (10,), 16), TIMEOUT_S)  # stale fence
        sender.push(float32.peer, Push("nobody", 1, (1,), (12,), 16), TIMEOUT_S)
        sender.push(float32.peer, Push("req-b", 5, (2,), (40,), 16), TIMEOUT_S)  # not reserved
        wrong = Push("req-b", 5, (2,), (10,), 16, capability=b"guessed")
        sender.push(float32.peer, wrong, TIMEOUT_S)  # the notification carries it
        # A malformed notification is counted and does not stop the receiver's thread.
        sender._nixl.agent.send_notif(float32.peer.endpoint["nixl.agent"].decode(), b"{oops")
        sender.push(float32.peer, Push("req-b", 5, (3, 4), (10, 11), 32), TIMEOUT_S)

        events = float32.wait_events(5)
        assert [e[:2] for e in events[:4]] == [
            ("refused", "req-b"), ("refused", "nobody"), ("refused", "req-b"), ("refused", "req-b")
        ]  # fmt: skip
        assert "FAILED_PRECONDITION" in events[0][2] and "stale fence 4" in events[0][2]
        assert "NOT_FOUND" in events[1][2]
        assert "outside the reservation" in events[2][2]
        assert "PERMISSION_DENIED" in events[3][2] and "capability" in events[3][2]
        assert events[4][:4] == ("landed", "req-b", 5, [10, 11])
        expected = {"num_pushes": 1, "num_refused": 4, "num_bytes": 2 * BLOCK_BYTES,
                    "num_malformed": 1, "num_unvouched": 0}  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S  # counters move just after the landing calls
        while (delta := float32.stats_since(before)) != expected and time.monotonic() < deadline:
            time.sleep(0.005)
        assert delta == expected
    finally:
        sender.close()


def test_push_to_a_killed_receiver_fails_then_its_restart_is_reached() -> None:
    remote = RemoteReceiver("float32")
    restarted: RemoteReceiver | None = None
    src_pool = make_pool(torch.float32, seed=9)
    sender = NixlSender(make_connector(src_pool), "prefill-0")
    try:
        remote.call("reserve", "req-k", 1, [0, 1, 2])
        sender.push(remote.peer, Push("req-k", 1, (5,), (0,), 16), TIMEOUT_S)
        remote.kill()

        started = time.monotonic()
        with pytest.raises(TransferError) as failed:
            sender.push(remote.peer, Push("req-k", 1, (6,), (1,), 32), timeout_s=2.0)
        assert failed.value.status == "UNAVAILABLE"
        assert time.monotonic() - started < 5.0

        # The worker comes back under a new agent name: a new peer entry, reached at once.
        restarted = RemoteReceiver("float32")
        assert restarted.peer.endpoint["nixl.agent"] != remote.peer.endpoint["nixl.agent"]
        restarted.call("reserve", "req-k", 2, [7])
        sender.push(restarted.peer, Push("req-k", 2, (6,), (7,), 32), TIMEOUT_S)
        assert restarted.wait_events(1)[0][:4] == ("landed", "req-k", 2, [7])
        assert torch.equal(as_bytes(restarted.pool()[7]), as_bytes(src_pool[6]))
    finally:
        sender.close()
        remote.close()
        if restarted is not None:
            restarted.close()


def test_a_peer_with_another_block_size_is_refused(float32: RemoteReceiver) -> None:
    sender = NixlSender(make_connector(make_pool(torch.float32, block_size=8)), "prefill-0")
    try:
        with pytest.raises(TransferError) as refused:
            sender.push(float32.peer, Push("req-x", 1, (0,), (0,), 8), TIMEOUT_S)
        assert refused.value.status == "FAILED_PRECONDITION"
        message = str(refused.value)
        assert f"{BLOCK_BYTES}-byte" in message and f"{BLOCK_BYTES // 2}-byte" in message
        assert float32.call("events") == []
    finally:
        sender.close()


def test_a_push_past_its_timeout_fails_and_the_next_one_lands(
    float32: RemoteReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over TCP (not shared memory) a 1 MiB write is still in flight when `transfer` returns.
    monkeypatch.setenv("UCX_TLS", "tcp")
    src_pool = make_pool(torch.float32, seed=13)
    sender = NixlSender(make_connector(src_pool), "prefill-0")
    try:
        float32.call("reserve", "req-t", 1, range(NUM_BLOCKS))
        everything = tuple(range(NUM_BLOCKS))
        with pytest.raises(TransferError, match="within 0 s") as late:
            sender.push(float32.peer, Push("req-t", 1, everything, everything, 1), timeout_s=0)
        assert late.value.status == "UNAVAILABLE"

        float32.call("reserve", "req-t", 2, range(NUM_BLOCKS))  # the request is retried
        sender.push(float32.peer, Push("req-t", 2, everything, everything, 1), TIMEOUT_S)
        events = float32.wait_events(1, landed=1)
        # The timed-out write was cancelled; had its notification come, fence 1 refuses it.
        assert [e[:3] for e in events if e[0] == "landed"] == [("landed", "req-t", 2)]
        assert torch.equal(as_bytes(float32.pool()), as_bytes(src_pool))
    finally:
        sender.close()


def test_without_nixl_the_sender_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)  # as if it were not installed
    with pytest.raises(RuntimeError, match="cannot import nixl_cu13"):
        NixlSender(make_connector(make_pool(torch.float32)), "prefill-0")
