"""Runs an `LLMEngine` on a thread of its own, for the services.

gRPC handlers never touch the engine: they `call` a function, which the engine thread runs
between steps, and read a request's outputs from the queue they `subscribe`d. Hooks run on the
engine thread after each step (a prefill worker uses one to start pushing finished blocks).

    handler ──call(fn)──▶ [commands] ──▶ engine thread: commands, step(), hooks ──▶ [outputs]
    handler ◀──────────────────────────────────────────────── subscribe(request_id) queue

Handlers on an asyncio loop use `call_async` and `subscribe_async`: the engine thread completes
their futures and feeds their queues with `loop.call_soon_threadsafe`, so waiting for the engine
holds no thread and never blocks the loop.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from splitserve.engine.aio import within
from splitserve.engine.errors import EngineStopped
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.stall_log import stall_log_s
from splitserve.engine.stats import STEP_BUCKETS_S, EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")
StepHook = Callable[[LLMEngine], None]
OutputSink = Callable[[list[RequestOutput]], None]


class EngineLoop:
    """Owns the engine thread. `call` and `subscribe` are safe from any thread."""

    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.05,
        sink: OutputSink | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`sink` (if any) gets every published batch of outputs on the engine thread, after
        the subscribers (an engine core sends them to its front); `on_failure` hears of the
        exception that ended the loop."""
        self.engine = engine
        self._sink = sink
        self._on_failure = on_failure
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], Any], Future[Any]]] = queue.Queue()
        # request id -> how to hand it an output (or the exception that ended the engine)
        self._subscribers: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._hooks: list[StepHook] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.failure: BaseException | None = None
        # Turns that stepped the engine with work waiting: how many, their wall seconds (the
        # commands run between steps, the step, outputs and hooks: the serving step), and the
        # sequences they ran (EngineStats' step fields).
        self.num_steps = 0
        self.step_seconds = 0.0
        self.num_step_seqs = 0
        self.step_bucket_counts = [0] * (len(STEP_BUCKETS_S) + 1)
        self.step_seconds_max = 0.0
        self._slow_turn_s = stall_log_s()
        self._slowest_command = (0.0, "")  # this turn's (seconds, name), for the slow-turn log

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def call(self, fn: Callable[[LLMEngine], T], timeout_s: float | None = 30.0) -> T:
        """Run `fn(engine)` on the engine thread; return its result or raise its exception."""
        return self.submit(fn).result(timeout_s)

    def stats(self) -> EngineStats:
        """The engine's stats with this loop's step counters (on the engine thread)."""
        return dataclasses.replace(
            self.engine.stats(),
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            num_step_seqs=self.num_step_seqs,
            step_bucket_counts=tuple(self.step_bucket_counts),
            step_seconds_max=self.step_seconds_max,
        )

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Queue `fn(engine)` for the engine thread; its future completes there."""
        if not self.running:
            raise EngineStopped("the engine is not running") from self.failure
        future: Future[T] = Future()
        self._commands.put((fn, future))
        return future

    async def call_async(self, fn: Callable[[LLMEngine], T], timeout_s: float | None = 30.0) -> T:
        """`call` for a coroutine: awaits the result without blocking the event loop (the engine
        thread completes the future through `loop.call_soon_threadsafe`). A command cancelled
        before the engine thread took it up does not run."""
        if not self.running:
            raise EngineStopped("the engine is not running") from self.failure
        future: Future[T] = Future()
        self._commands.put((fn, future))
        return await within(asyncio.wrap_future(future), timeout_s)

    def subscribe(self, request_id: str) -> queue.Queue[RequestOutput | BaseException]:
        """A queue that receives every output of `request_id` (or the exception that ended the
        engine). Subscribe before the request is added so nothing is missed."""
        q: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        with self._lock:
            self._subscribers[request_id] = q.put
        return q

    def subscribe_async(
        self, request_id: str, loop: asyncio.AbstractEventLoop
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """`subscribe` for a coroutine on `loop`: an asyncio queue that the engine thread feeds
        through `loop.call_soon_threadsafe`."""
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def deliver(item: RequestOutput | BaseException) -> None:
            # NOTE: a closed loop raises RuntimeError; nobody waits for this any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(q.put_nowait, item)

        with self._lock:
            self._subscribers[request_id] = deliver
        return q

    def unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)

    def add_step_hook(self, hook: StepHook) -> None:
        with self._lock:
            self._hooks.append(hook)

    def remove_step_hook(self, hook: StepHook) -> None:
        with self._lock:
            if hook in self._hooks:
                self._hooks.remove(hook)

    def _run(self) -> None:
        try:
            self.engine.platform.activate()  # NOTE: the current GPU is per thread
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                started = time.perf_counter()
                ran = self._run_commands(block=not busy)
                commanded = time.perf_counter()
                self.engine.housekeeping()
                if self.engine.has_unfinished_requests():
                    num_seqs = self.engine.num_running_seqs()
                    kept = time.perf_counter()
                    outputs = self.engine.step()
                    stepped = time.perf_counter()
                    self.publish(outputs)
                    with self._lock:
                        hooks = list(self._hooks)
                    for hook in hooks:
                        hook(self.engine)
                    if busy:  # NOTE: a turn that waited for work first is not a serving step
                        ended = time.perf_counter()
                        self._count_step(ended - started, num_seqs)
                        if self._slow_turn_s and ended - started > self._slow_turn_s:
                            times = (started, commanded, kept, stepped, ended)
                            self._log_slow_turn(times, ran, num_seqs, len(outputs))
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
            log.exception("engine loop failed")
            self.failure = exc
            self._stop.set()
            with self._lock:
                subscribers = list(self._subscribers.values())
            for deliver in subscribers:
                deliver(EngineStopped(f"engine failed: {exc!r}"))
            self.engine.kv_connector.fail_all(EngineStopped(f"engine failed: {exc!r}"))
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            self._fail_pending_commands()

    def _count_step(self, seconds: float, num_seqs: int) -> None:
        self.step_seconds += seconds
        self.num_steps += 1
        self.num_step_seqs += num_seqs
        self.step_bucket_counts[bisect.bisect_left(STEP_BUCKETS_S, seconds)] += 1
        self.step_seconds_max = max(self.step_seconds_max, seconds)

    def _log_slow_turn(
        self, times: tuple[float, ...], commands: int, num_seqs: int, num_outputs: int
    ) -> None:
        started, commanded, kept, stepped, ended = (1e3 * t for t in times)
        log.warning(
            "slow engine turn %.1f ms at monotonic %.3f: %d commands %.1f ms, housekeeping "
            "%.1f ms, step %.1f ms (%d sequences), outputs and hooks %.1f ms (%d outputs); "
            "slowest command %s %.1f ms",
            ended - started, time.monotonic(), commands, commanded - started, kept - commanded,
            stepped - kept, num_seqs, ended - stepped, num_outputs,
            self._slowest_command[1] or "-", 1e3 * self._slowest_command[0],
        )  # fmt: skip

    def _run_commands(self, block: bool) -> int:
        """Run the queued commands (waiting up to the idle wait for one if `block`); how many."""
        self._slowest_command = (0.0, "")
        try:
            fn, future = self._commands.get(timeout=self._idle_wait_s if block else 0.0)
        except queue.Empty:
            return 0
        ran = 0
        while True:
            ran += 1
            if future.set_running_or_notify_cancel():
                began = time.perf_counter() if self._slow_turn_s else 0.0
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
                if self._slow_turn_s:  # NOTE: timed only for the stall log
                    took = time.perf_counter() - began
                    if took > self._slowest_command[0]:
                        self._slowest_command = (took, getattr(fn, "__qualname__", repr(fn)))
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return ran

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Deliver outputs to their subscribers (after a step, or from a command that produced
        some, e.g. a request finished on admission)."""
        with self._lock:
            for out in outputs:
                deliver = self._subscribers.get(out.request_id)
                if deliver is not None:
                    deliver(out)
        if self._sink is not None and outputs:
            self._sink(outputs)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine stopped"))
