"""A NIXL receiver in a process of its own, for the NIXL transport's tests: it lands pushes
into its own pool through a recording `Landing` (or, with a registry, vets senders as a decode
worker does), and the test drives it over a pipe (`RemoteReceiver`: reserve, read its pool,
read what landed, kill it).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection
from typing import Any

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.nixl_receiver import NixlReceiver
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.transport import Peer, PushRefused, ReceiverBind

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

    def refused(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], reason: str
    ) -> bool:
        with self.lock:
            self.events.append(("refused", request_id, reason))
        return True

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


def as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8)
