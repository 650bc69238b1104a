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

With sliding layers kept apart (engine/window_slots.py) the region has a second part, the
window pool (`KVRegion.window`): a block moves as its full layers' run, and, where the
receiver gave it a window slot (`Reservation.window_slots`: the blocks its first query sees),
its sliding layers' run from the sender's slot, which `watch(..., window_from)` pins with it.

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
class WindowRegion:
    """The sliding layers' window pool: slot s is the `slot_bytes` bytes at `base_address + s *
    slot_bytes`, each sliding layer's page (the block pool's page shape) in turn."""

    tensor: torch.Tensor  # [num_slots, num_layers, *page]
    num_slots: int
    slot_bytes: int
    num_layers: int

    @property
    def base_address(self) -> int:
        return int(self.tensor.data_ptr())


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
    # The sliding layers' window pool, when kept apart (then `num_layers` counts full layers).
    window: WindowRegion | None = None

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

    `block_ids[i]` is the pool block holding the request's prompt block `first_index + i`;
    `window_slots[i]` its sliding layers' slot, pinned with it (0: not asked for, or none).
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
    window_slots: tuple[int, ...] = ()

    def wait(self) -> None:
        """Block this thread until the blocks' writes are done (no-op on the CPU)."""
        if self.ready is not None:
            self.ready.synchronize()


class KVOutbox:
    """What one watched request has ready to send, in prompt order."""

    def __init__(self, request_id: str, first_index: int, window_from: int | None) -> None:
        self.request_id = request_id
        self.next_index = first_index  # engine thread only
        self.window_from = window_from  # first prompt block whose window slot is sent
        self.pinned: set[int] = set()  # engine thread only
        self.window_pinned: set[int] = set()  # of them, those whose window slot is pinned too
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
        pool, wpool = self._cache.pool, self._cache.window_pool
        _, num_layers, num_planes, block_size, num_kv_heads, head_dim = pool.shape
        window = None
        if wpool is not None:
            slot_bytes = int(wpool[0].numel() * wpool.element_size())
            window = WindowRegion(wpool, int(wpool.shape[0]), slot_bytes, int(wpool.shape[1]))
        return KVRegion(
            pool, self._cache.num_blocks, self._cache.block_bytes, num_layers, block_size,
            num_kv_heads, head_dim, num_planes, window=window,
        )  # fmt: skip

    def is_watching(self, request_id: str) -> bool:
        return request_id in self._outboxes

    # -- prefill side -----------------------------------------------------------------------

    def watch(self, request_id: str, first_index: int, window_from: int | None = None) -> KVOutbox:
        """Report `request_id`'s blocks from prompt block `first_index` on (the earlier ones the
        receiver caches already), with the window slots of those from `window_from` on (the
        ones the receiver gave slots) pinned too. Engine thread (call it in the command that
        adds the request)."""
        outbox = KVOutbox(request_id, first_index, window_from)
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
                    self._unpin(outbox, block_id)
        for request_id in pending.unwatched:
            outbox = self._outboxes.pop(request_id, None)
            if outbox is not None:
                for block_id in outbox.pinned:
                    self._unpin(outbox, block_id)
                outbox.pinned.clear()

    def _unpin(self, outbox: KVOutbox, block_id: int) -> None:
        window = block_id in outbox.window_pinned
        outbox.window_pinned.discard(block_id)
        self._bm.unpin(block_id, window=window)

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
            start = len(table) if outbox.window_from is None else outbox.window_from
            slots = tuple(
                self._bm.pin(b, window=outbox.next_index + i >= start)
                for i, b in enumerate(block_ids)
            )
            outbox.pinned.update(block_ids)
            outbox.window_pinned.update(b for b, slot in zip(block_ids, slots, strict=True) if slot)
            first, outbox.next_index = outbox.next_index, max(end, outbox.next_index)
            outbox.complete = done
            num_tokens = min(outbox.next_index * self.block_size, prompt_len)
            batch = ReadyBlocks(
                outbox.request_id, first, block_ids, num_tokens, done,
                window_slots=slots if any(slots) else (),
            )  # fmt: skip
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
        return self._gather(self._cache.pool, block_ids, out, ready)

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Land `data` ([n, *block shape], host or device) in these (reserved) blocks; returns
        once the copy is done and visible to the engine."""
        self._scatter(self._cache.pool, block_ids, data)

    def _gather(
        self, pool: torch.Tensor, ids: Sequence[int], out: torch.Tensor, ready: ReadyBlocks | None
    ) -> torch.Tensor:
        with self._side_stream():
            if ready is not None and ready.ready is not None:
                torch.cuda.current_stream().wait_event(ready.ready)
            index = torch.tensor(list(ids), dtype=torch.long, device=pool.device)
            _bytes(out).copy_(_bytes(pool).index_select(0, index), non_blocking=True)
            self._synchronize()
        return out

    def _scatter(self, pool: torch.Tensor, ids: Sequence[int], data: torch.Tensor) -> None:
        with self._side_stream():
            index = torch.tensor(list(ids), dtype=torch.long, device=pool.device)
            _bytes(pool).index_copy_(0, index, _bytes(data).to(pool.device, non_blocking=True))
            self._synchronize()

    def read_slots(
        self, slots: Sequence[int], out: torch.Tensor, ready: ReadyBlocks | None = None
    ) -> torch.Tensor:
        """`read_blocks` for the window pool's slots (`out`: [n, *slot shape])."""
        return self._gather(self._window_pool(), slots, out, ready)

    def write_slots(self, slots: Sequence[int], data: torch.Tensor) -> None:
        """`write_blocks` for the window pool's (reserved) slots."""
        self._scatter(self._window_pool(), slots, data)

    def _window_pool(self) -> torch.Tensor:
        if self._cache.window_pool is None:
            raise ValueError("this KV pool keeps no window pool: every layer is in its blocks")
        return self._cache.window_pool

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
