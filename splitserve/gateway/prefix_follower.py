"""Keeps the gateway's in-memory prefix index (prefix_view.py) in step with the registry's,
from the index's change log (kv_transfer/prefix_events.py), in a thread of its own.

It starts from the log's last id, then the sets, then every entry after that id (no gap: see
prefix_events.py), and then waits on the log (XREAD BLOCK), applying each change as it lands
(a fraction of a millisecond after the worker's publish). Every `live_every_s` it takes the
live workers from the registry: an id not live (it died without leaving) stops counting at
once, before the sweeps clear it. A worker that is cleared (it left, restarted, died, or the
gateway moved its streams) drops out with its clear's entry.

It never guesses: until it has caught up, after a gap (it fell more than the log's length
behind, or Redis lost its data: it reads the sets again), and while Redis does not answer,
`match_tiers` returns None and the router asks Redis itself (`Registry.prefix_match_tiers`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence

import redis

from splitserve.gateway.prefix_view import PrefixView
from splitserve.gateway.prompt_chain import ChainMemo, PromptChain
from splitserve.kv_transfer.prefix_events import ADD, CLEAR, REMOVE, Event, PrefixEventLog
from splitserve.kv_transfer.registry import WORKER_KINDS, Registry, RegistryError

log = logging.getLogger(__name__)


def live_ids(registry: Registry) -> Callable[[], set[str]]:
    """The ids of every live worker, of every kind."""
    return lambda: {w.worker_id for k in WORKER_KINDS for w in registry.live_workers(k)}


class PrefixFollower:
    """The registry's prefix index, followed in memory (`start`, then `match_tiers`)."""

    def __init__(
        self,
        events: PrefixEventLog,
        live: Callable[[], Collection[str]] | None,
        block_ms: int = 250,
        live_every_s: float = 0.5,
        stale_s: float = 2.0,
        memo_segments: int = 2048,
    ) -> None:
        """`live`: the live workers' ids (None: every id in the index counts); `stale_s`:
        how long without an answer from Redis before the copy is no longer trusted;
        `memo_segments`: how many segments of recently routed prompts' hashes to keep
        (prompt_chain.ChainMemo; 0: none)."""
        self.view = PrefixView()
        self.memo = ChainMemo(memo_segments) if memo_segments else None
        self._events = events
        self._live = live
        self._block_ms = block_ms
        self._live_every_s = live_every_s
        self._stale_s = stale_s
        self._last: str | None = None  # the last log id applied (None: must read the sets)
        self._answered = -float("inf")  # when Redis last answered a read (monotonic)
        self._next_live = 0.0
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="prefix-follower", daemon=True)
        self.rebuilds = 0  # reads of the sets (the first, and one per gap or outage)
        self.applied_at = 0.0  # when the last changes were applied (time.perf_counter)
        self.answered = self.declined = 0  # lookups answered from memory, left to Redis

    def start(self) -> PrefixFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (within its read's wait) and close its Redis client."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._events.close()

    def in_step(self) -> bool:
        """Caught up with the log, and Redis answered within `stale_s`."""
        return self._last is not None and time.monotonic() - self._answered < self._stale_s

    def match_tiers(
        self, token_ids: Sequence[int], block_size: int
    ) -> dict[str, tuple[int, int]] | None:
        """`Registry.prefix_match_tiers(prefix_block_hashes(token_ids, block_size))` for the
        live workers, from memory; None while not in step (ask Redis)."""
        if not self.in_step():
            self.declined += 1
            return None
        self.answered += 1
        chain = PromptChain(token_ids, block_size, memo=self.memo)
        with self.view.lock:
            return self.view.match(chain)

    def wait_applied(self, last_id: str, timeout_s: float) -> bool:
        """Wait until the log's entries up to `last_id` are applied; False at the timeout."""
        want = _id(last_id)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._last is None or _id(self._last) < want:
                left = deadline - time.monotonic()
                if left <= 0 or not self._changed.wait(left):
                    return False
        return True

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self._step()
                if failing:
                    log.info("prefix index: following the registry's again")
                failing = False
            except (redis.RedisError, RegistryError) as exc:
                self._last = None  # NOTE: read the sets again once Redis answers
                if not failing:
                    log.warning("prefix index: Redis unreachable (%s); routing asks Redis", exc)
                failing = True
                self._stop.wait(0.2)
            except Exception:
                # NOTE: not in step (routing asks Redis) until a fresh start works
                self._last = None
                if not failing:
                    log.exception("prefix index: following failed; routing asks Redis")
                failing = True
                self._stop.wait(1.0)

    def _step(self) -> None:
        block_ms: int | None = self._block_ms
        if self._last is None:
            self._rebuild()
            block_ms = None  # NOTE: in step as soon as the entries after the sets are applied
        assert self._last is not None
        now = time.monotonic()
        if self._live is not None and now >= self._next_live:
            live = self._live()
            self._next_live = now + self._live_every_s
            with self.view.lock:
                self.view.set_live(live)
        got = self._events.read(self._last, block_ms)
        if got is None:
            log.warning("prefix index: missed changes (fell behind the log); reading it again")
            self._last = None
            return
        events, last = got
        if events:
            with self.view.lock:
                for event in events:
                    _apply(self.view, event)
            self.applied_at = time.perf_counter()
        self._answered = time.monotonic()
        with self._changed:
            self._last = last
            self._changed.notify_all()

    def _rebuild(self) -> None:
        head = self._events.head()
        snapshot = self._events.snapshot()
        live = self._live() if self._live is not None else None
        self._next_live = time.monotonic() + self._live_every_s
        with self.view.lock:
            self.view.load(snapshot)
            self.view.set_live(live)
        self.rebuilds += 1
        # NOTE: not in step until the entries after `head` are applied (the next read)
        self._answered = -float("inf")
        self._last = head


def _apply(view: PrefixView, event: Event) -> None:
    if event.op == ADD:
        view.add(event.index_id, event.hashes)
    elif event.op == REMOVE:
        view.remove(event.index_id, event.hashes)
    elif event.op == CLEAR:
        view.clear(event.index_id)


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
