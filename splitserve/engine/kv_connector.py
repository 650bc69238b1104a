"""The engine's one seam for moving KV blocks between workers.

Prefill side: `watch` a request before it is added; after every engine step the connector
finds the blocks of each watched request that became complete, pins them (no preemption,
abort or prefix eviction can free or reuse a pinned block) and hands them to the request's
`KVOutbox` with a device event that marks when their writes are done. The sender copies from
the pinned blocks straight out of the pool (no snapshot on the engine thread) and `release`s
them once the receiver has them.

    engine step ──▶ after_step: new complete blocks ──pin──▶ outbox ──▶ sender thread
                                                                       transport.push
                    drain_releases ◀── release(ids) ◀──────────────────  acknowledged

Decode side: `LLMEngine.reserve` holds blocks for a prompt, `region` exposes the pool for a
transport to register and `write_blocks` lands a payload; `LLMEngine.admit` starts the request
once every block is there.

NOTE: `after_step` and `drain_releases` run on the engine thread only; `release`, `unwatch`,
`region`, `write_blocks` and `read_blocks` are safe from any thread. Reading and writing blocks
from other threads is safe because pinned (prefill) and reserved (decode) blocks belong to no
running sequence that could write them.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache


@dataclass(frozen=True)
class KVRegion:
    """The block-major pool, as a transport registers it: block b is the `block_bytes` bytes
    at `base_address + b * block_bytes`, every layer's page (`kv_cache.kv_page`) in turn.

    A page is `num_planes` planes of `block_size` tokens x `num_kv_heads` rows x `head_dim`:
    keys then values (2 planes of the KV heads), or MLA's latents (1 plane of one row as wide
    as the latent: `num_kv_heads` 1, `head_dim` kv_lora_rank + qk_rope_head_dim)."""

    tensor: torch.Tensor
    num_blocks: int
    block_bytes: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_planes: int = 2
    # False when the pool's bytes are not the wire's (a tensor-parallel rank holds some heads;
    # engine/parallel/kv_shards.py): only transports that copy through the connector serve it.
    addressable: bool = True

    @property
    def page(self) -> tuple[int, int, int, int]:
        """One layer's page of one block: (planes, block_size, heads, dim)."""
        return (self.num_planes, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def base_address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


@dataclass(frozen=True)
class ReadyBlocks:
    """Blocks of a watched request whose KV is complete (pinned until released).

    `block_ids[i]` is the pool block holding the request's prompt block `first_index + i`.
    `ready` (on a GPU) is recorded after the step that computed them: a reader on another
    stream or engine waits for it first. `num_tokens` is how many prompt tokens are complete
    up to and including these blocks; `is_last` marks the request's final batch.
    """

    request_id: str
    first_index: int
    block_ids: tuple[int, ...]
    num_tokens: int
    is_last: bool
    ready: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Block this thread until the blocks' writes are done (no-op on the CPU)."""
        if self.ready is not None:
            self.ready.synchronize()


class KVOutbox:
    """What one watched request has ready to send, in prompt order."""

    def __init__(self, request_id: str, first_index: int) -> None:
        self.request_id = request_id
        self.next_index = first_index  # engine thread only
        self.pinned: set[int] = set()  # engine thread only
        self.complete = False  # the last batch went out (engine thread only)
        self._queue: queue.Queue[ReadyBlocks | BaseException] = queue.Queue()

    def get(self, timeout_s: float | None = None) -> ReadyBlocks:
        """The next batch of ready blocks; raises queue.Empty on timeout, or the error that ended
        the request (it was aborted, or the engine stopped)."""
        item = self._queue.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    def put(self, item: ReadyBlocks | BaseException) -> None:
        self._queue.put(item)


@dataclass
class _Pending:
    releases: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    unwatched: list[str] = field(default_factory=list)


class KVConnector:
    """Owned by an `LLMEngine`; see the module doc for who calls what, from where."""

    def __init__(self, cache: KVCache, block_manager: BlockManager, block_size: int) -> None:
        self._cache = cache
        self._bm = block_manager
        self.block_size = block_size
        self._outboxes: dict[str, KVOutbox] = {}
        self._pending = _Pending()
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        if cache.pool.is_cuda:
            self._stream = torch.cuda.Stream(device=cache.pool.device)

    # -- both sides -----------------------------------------------------------------------

    def region(self) -> KVRegion:
        if self._cache.window_pool is not None:
            raise ValueError(
                "a KV pool whose sliding layers have a window pool of their own cannot be "
                "transferred: build the engine with sliding_window_kv=False"
            )
        pool = self._cache.pool
        _, num_layers, num_planes, block_size, num_kv_heads, head_dim = pool.shape
        return KVRegion(
            pool, self._cache.num_blocks, self._cache.block_bytes, num_layers, block_size,
            num_kv_heads, head_dim, num_planes,
        )  # fmt: skip

    def is_watching(self, request_id: str) -> bool:
        return request_id in self._outboxes

    # -- prefill side -----------------------------------------------------------------------

    def watch(self, request_id: str, first_index: int) -> KVOutbox:
        """Report `request_id`'s blocks from prompt block `first_index` on (the earlier ones the
        receiver caches already). Engine thread (call it in the command that adds the request)."""
        outbox = KVOutbox(request_id, first_index)
        self._outboxes[request_id] = outbox
        return outbox

    def release(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The receiver has these blocks: unpin them (on the engine thread's next turn)."""
        with self._lock:
            self._pending.releases.append((request_id, tuple(block_ids)))

    def unwatch(self, request_id: str) -> None:
        """Stop reporting `request_id` and unpin whatever of it is still pinned."""
        with self._lock:
            self._pending.unwatched.append(request_id)

    def drain_releases(self) -> None:
        """Engine thread: apply the releases and unwatches queued since the last call."""
        with self._lock:
            pending, self._pending = self._pending, _Pending()
        for request_id, block_ids in pending.releases:
            outbox = self._outboxes.get(request_id)
            if outbox is None:
                continue
            for block_id in block_ids:
                if block_id in outbox.pinned:
                    outbox.pinned.discard(block_id)
                    self._bm.unpin(block_id)
        for request_id in pending.unwatched:
            outbox = self._outboxes.pop(request_id, None)
            if outbox is not None:
                for block_id in outbox.pinned:
                    self._bm.unpin(block_id)
                outbox.pinned.clear()

    def after_step(self, progress: Callable[[str], tuple[int, int, list[int]] | None]) -> list[str]:
        """Engine thread, after a step: pin and report newly complete blocks of every watched
        request; returns the requests whose last batch went out this step.

        `progress(request_id)` is (computed prompt tokens, prompt length, block table) of the
        request's first sequence, or None while it holds no blocks (queued, or preempted: its
        unsent blocks come again after recompute).
        """
        ready: list[tuple[KVOutbox, ReadyBlocks]] = []
        for outbox in self._outboxes.values():
            state = None if outbox.complete else progress(outbox.request_id)
            if state is None:
                continue
            computed, prompt_len, table = state
            num_blocks = -(-prompt_len // self.block_size)
            done = computed >= prompt_len
            end = num_blocks if done else computed // self.block_size
            if end <= outbox.next_index and not done:
                continue
            block_ids = tuple(table[outbox.next_index : end])
            for block_id in block_ids:
                self._bm.pin(block_id)
            outbox.pinned.update(block_ids)
            first, outbox.next_index = outbox.next_index, max(end, outbox.next_index)
            outbox.complete = done
            num_tokens = min(outbox.next_index * self.block_size, prompt_len)
            batch = ReadyBlocks(outbox.request_id, first, block_ids, num_tokens, done)
            ready.append((outbox, batch))
        if not ready:
            return []
        event: torch.cuda.Event | None = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record()  # NOTE: on the compute stream, after the step's kernels
        for outbox, batch in ready:
            outbox.put(dataclasses.replace(batch, ready=event))
        return [outbox.request_id for outbox, batch in ready if batch.is_last]

    def fail_all(self, error: BaseException) -> None:
        """The engine stopped: every watched request ends with `error`."""
        for outbox in list(self._outboxes.values()):
            outbox.put(error)

    def fail(self, request_id: str, error: BaseException) -> None:
        """Engine thread: the watched request ended without all its blocks (aborted)."""
        outbox = self._outboxes.get(request_id)
        if outbox is not None:
            outbox.put(error)

    # -- copies out of and into the pool (any thread) -----------------------------------------

    def read_blocks(
        self, block_ids: Sequence[int], out: torch.Tensor, ready: ReadyBlocks | None = None
    ) -> torch.Tensor:
        """Gather whole blocks into `out` ([n, *block shape], host memory, pinned on a GPU
        host) on a side stream, after `ready`'s event; returns `out` once the copy is done."""
        pool = self._cache.pool
        with self._side_stream():
            if ready is not None and ready.ready is not None:
                torch.cuda.current_stream().wait_event(ready.ready)
            index = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
            _bytes(out).copy_(_bytes(pool).index_select(0, index), non_blocking=True)
            self._synchronize()
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Land `data` ([n, *block shape], host or device) in these (reserved) blocks; returns
        once the copy is done and visible to the engine."""
        pool = self._cache.pool
        with self._side_stream():
            index = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
            _bytes(pool).index_copy_(0, index, _bytes(data).to(pool.device, non_blocking=True))
            self._synchronize()

    def _side_stream(self) -> torch.cuda.StreamContext | _NoStream:
        return torch.cuda.stream(self._stream) if self._stream is not None else _NoStream()

    def _synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


def _bytes(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [n, ...] as raw bytes [n, ...]: copies move bits, whatever the dtype (the CPU has
    no indexed copies of FP8)."""
    return blocks.view(torch.uint8) if blocks.dtype == torch.float8_e4m3fn else blocks


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
