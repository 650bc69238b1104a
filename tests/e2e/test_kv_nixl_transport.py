"""KV blocks over real NIXL (UCX, DRAM to DRAM) between this process and a receiver process.

The receiver runs in a spawned process with its own pool and a recording `Landing`; the test
drives it over a pipe (reserve, read its pool, read what landed) and pushes from a `NixlSender`
here: bit-exact landing, concurrent pushes, refusals, a killed peer, a timeout, a block-size
mismatch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.nixl_receiver import NixlReceiver
from splitserve.kv_transfer.nixl_transport import NixlSender
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.transport import (
    Peer,
    Push,
    PushRefused,
    ReceiverBind,
    TransferError,
)

pytestmark = pytest.mark.slow

# One block over all layers: 2 layers * 2 (k, v) * 16 tokens * 2 heads * 32 dims.
NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 64, 2, 16, 2, 32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # float32
TIMEOUT_S = 10.0


def make_connector(pool: torch.Tensor) -> KVConnector:
    num_blocks, block_size = pool.shape[0], pool.shape[3]
    return KVConnector(KVCache.over(pool), BlockManager(num_blocks, block_size), block_size)


def make_pool(
    dtype: torch.dtype, block_size: int = BLOCK_SIZE, seed: int | None = None
) -> torch.Tensor:
    shape = (NUM_BLOCKS, NUM_LAYERS, 2, block_size, NUM_KV_HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- the receiver process ------------------------------------------------------------------


class RecordingLanding:
    """Reservations (request -> fence, blocks) and a log of every landed / refused call."""

    def __init__(self) -> None:
        self.reservations: dict[str, tuple[int, frozenset[int], set[int]]] = {}
        self.events: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def _reservation(self, request_id: str, fence: int) -> tuple[frozenset[int], set[int]]:
        if request_id not in self.reservations:
            raise PushRefused("NOT_FOUND", f"no reservation {request_id!r}")
        current, blocks, landed = self.reservations[request_id]
        if current != fence:
            raise PushRefused("FAILED_PRECONDITION", f"stale fence {fence} (now {current})")
        return blocks, landed

    def allowed_blocks(self, request_id: str, fence: int) -> frozenset[int]:
        with self.lock:
            blocks, landed = self._reservation(request_id, fence)
            return blocks - landed

    def landed(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], num_bytes: int
    ) -> None:
        with self.lock:
            _, landed = self._reservation(request_id, fence)
            landed.update(dst_block_ids)
            self.events.append(("landed", request_id, fence, list(dst_block_ids), num_bytes))

    def refused(self, request_id: str, reason: str) -> None:
        with self.lock:
            self.events.append(("refused", request_id, reason))

    def check_capability(self, request_id: str, capability: bytes) -> None:
        if capability:  # the test's reservations carry none: a push that brings one is wrong
            raise PushRefused("PERMISSION_DENIED", f"{request_id!r}: wrong capability")

    def hold(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], num_bytes: int
    ) -> AbstractContextManager[None]:
        raise AssertionError("NIXL writes one-sided: its receiver never holds a reservation")


def receiver_main(conn: Connection, dtype_name: str, redis_url: str = "", secret: str = "") -> None:
    """Serve the test's commands until told to quit (or the test process goes away). With
    `redis_url`, as a decode worker does: senders vetted by the registry (cluster `secret`),
    the endpoint published there."""
    pool = make_pool(DTYPES[dtype_name])
    landing = RecordingLanding()
    registry = Registry(redis_url, secret=secret) if redis_url else None
    bind = ReceiverBind(vouch=registry.kv_endpoint_values) if registry is not None else None
    receiver = NixlReceiver(make_connector(pool), landing, "decode-0", bind=bind)
    if registry is not None:
        info = WorkerInfo("decode-0", "decode", "unused:0", block_size=BLOCK_SIZE,
                          kv_transports=("nixl",))  # fmt: skip
        registry.register_worker(info, ttl_s=600, kv_endpoint=receiver.endpoint())
    conn.send(receiver.endpoint())
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "quit":
                break
            with landing.lock:
                if cmd == "reserve":
                    request_id, fence, blocks = args
                    landing.reservations[request_id] = (fence, frozenset(blocks), set())
                    conn.send(None)
                elif cmd == "reset":
                    pool.zero_()
                    landing.reservations.clear()
                    landing.events.clear()
                    conn.send(None)
                elif cmd == "events":
                    conn.send(list(landing.events))
                elif cmd == "pool":
                    conn.send(pool.view(torch.uint8).numpy().tobytes())
                elif cmd == "stats":
                    names = ("num_pushes", "num_refused", "num_bytes", "num_malformed",
                             "num_unvouched")  # fmt: skip
                    conn.send({name: getattr(receiver, name) for name in names})
    except EOFError:
        pass
    finally:
        receiver.close()
        if registry is not None:
            registry.close()


class RemoteReceiver:
    """The test's handle on one receiver process."""

    def __init__(self, dtype_name: str, redis_url: str = "", secret: str = "") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.dtype = DTYPES[dtype_name]
        args = (child, dtype_name, redis_url, secret)
        self.process = ctx.Process(target=receiver_main, args=args, daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(60):
            raise TimeoutError("the receiver process did not start")
        self.peer = Peer("decode-0", "unused:0", self.conn.recv())

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"receiver did not answer {cmd[0]!r}")
        return self.conn.recv()

    def wait_events(self, count: int, landed: int = 0) -> list[tuple[Any, ...]]:
        """The receiver's landing log once it holds `count` entries, `landed` of them landed
        (notifications arrive after the sender's push returned)."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            events = self.call("events")
            if len(events) >= count and sum(e[0] == "landed" for e in events) >= landed:
                return events
            assert time.monotonic() < deadline, f"expected {count} landing events, got {events}"
            time.sleep(0.005)

    def stats_since(self, before: dict[str, int]) -> dict[str, int]:
        return {name: value - before[name] for name, value in self.call("stats").items()}

    def pool(self) -> torch.Tensor:
        data = torch.frombuffer(bytearray(self.call("pool")), dtype=torch.uint8)
        return data.view(self.dtype).reshape(make_pool(self.dtype).shape)

    def kill(self) -> None:
        if self.process.is_alive() and self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("quit",))
            self.process.join(10)
        self.kill()
        self.conn.close()


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


def as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8)


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
