"""The front process's door to its engine core: start it, call its commands, get its outputs.

`EngineCoreClient` starts the core (a process of its own, or a thread for tests that reach
inside it), waits for it to load, and runs one receiver thread that reads the core's event
stream: replies complete the callers' futures; each step's entries are turned into outputs
(detokenized here) and handed to the subscribers, one hand-off per event loop per step.
A core that dies (crash, SIGKILL) fails every waiter and calls `on_death`: the worker is then
dead as a whole, as it would be if its one process had died.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq
from transformers import PreTrainedTokenizerBase

from splitserve.engine.aio import within
from splitserve.engine.errors import EngineStopped
from splitserve.engine.outputs import RequestOutput
from splitserve.runtime.engine_core.assembler import OutputAssembler
from splitserve.runtime.engine_core.protocol import STOP, error_from_wire, pack, unpack

log = logging.getLogger(__name__)

CoreTarget = Callable[[Any, str, str, bool], None]
"""The core's entry point: (spec, command address, event address, own process)."""

Item = RequestOutput | BaseException


@dataclass
class _Subscriber:
    assembler: OutputAssembler
    loop: asyncio.AbstractEventLoop | None
    queue: asyncio.Queue[Item] | queue.Queue[Item]


class StreamQueue(asyncio.Queue):  # type: ignore[type-arg]
    """A request's outputs on an event loop. `direct`, if set, is offered each output as it is
    delivered while nothing waits in the queue, and keeps it by returning True (a consumer that
    handles an output synchronously saves a task wake per token); an output it declines, and
    every one behind another, is queued as usual, so the order holds."""

    direct: Callable[[Item], bool] | None = None


class CoreStartError(RuntimeError):
    """The engine core failed to start; `kind` is its exception's class name."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class EngineCoreClient:
    def __init__(
        self,
        target: CoreTarget,
        spec: Any,
        tokenizer: PreTrainedTokenizerBase | None,
        own_process: bool = True,
        name: str = "engine-core",
    ) -> None:
        self._target, self._spec, self._own_process, self._name = (
            target, spec, own_process, name,
        )  # fmt: skip
        self.tokenizer = tokenizer
        self.info: dict[str, Any] = {}
        self.failure: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self.on_kv: Callable[[int, float | None, bool], None] | None = None
        self.on_progress: Callable[[dict[str, int]], None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Any]] = {}
        self._subs: dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._dir = tempfile.mkdtemp(prefix="splitserve-core-")
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._command_address = f"ipc://{self._dir}/commands"
        self._event_address = f"ipc://{self._dir}/events"
        self._commands.bind(self._command_address)
        self._events.bind(self._event_address)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None
        self._receiver: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 1800.0) -> EngineCoreClient:
        """Start the core and wait until it has loaded (or raise what stopped it)."""
        args = (self._spec, self._command_address, self._event_address, self._own_process)
        if self._own_process:
            ctx = multiprocessing.get_context("spawn")
            self._process = ctx.Process(target=self._target, args=args, name=self._name)
            self._process.daemon = True
            self._process.start()
        else:
            self._thread = threading.Thread(
                target=self._target, args=args, name=self._name, daemon=True
            )
            self._thread.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._events.poll(200):
                event = unpack(self._events.recv())
                if event[0] == "ready":
                    self.info = event[1]
                    break
                if event[0] == "failed":
                    self._reap()
                    raise CoreStartError(event[1], event[2] if len(event) > 2 else "")
                continue
            if not self.alive:
                self._reap()
                raise CoreStartError(f"the engine core exited with code {self.exitcode}", "")
            if time.monotonic() > deadline:
                self._reap()
                raise CoreStartError(f"the engine core did not start in {timeout_s:.0f} s", "")
        self._receiver = threading.Thread(
            target=self._receive, name=f"{self._name}-rx", daemon=True
        )
        self._receiver.start()
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        if self._process is not None:
            return self._process.is_alive()
        return self._thread is not None and self._thread.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    @property
    def running(self) -> bool:
        return self.failure is None and not self._stopping and self.alive

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the core (it closes its transports and engine) and wait for it."""
        self._stopping = True
        with contextlib.suppress(zmq.ZMQError), self._send_lock:
            self._commands.send(pack([0, STOP, []]))
        self._reap(timeout_s)
        self._fail_all(EngineStopped("the engine stopped"))

    def _reap(self, timeout_s: float = 15.0) -> None:
        if self._process is not None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        elif self._thread is not None:
            self._thread.join(timeout_s)
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(2)
        with contextlib.suppress(zmq.ZMQError):
            self._commands.close()
            self._events.close()
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- commands ----------------------------------------------------------------------------

    def submit(self, method: str, *args: Any) -> Future[Any]:
        if self.failure is not None or self._stopping:
            raise EngineStopped("the engine is not running") from self.failure
        call_id = next(self._ids)
        future: Future[Any] = Future()
        with self._lock:
            self._pending[call_id] = future
        with self._send_lock:
            self._commands.send(pack([call_id, method, list(args)]))
        return future

    def call(self, method: str, *args: Any, timeout_s: float | None = 30.0) -> Any:
        return self.submit(method, *args).result(timeout_s)

    async def acall(self, method: str, *args: Any, timeout_s: float | None = 30.0) -> Any:
        return await within(asyncio.wrap_future(self.submit(method, *args)), timeout_s)

    # -- outputs -----------------------------------------------------------------------------

    def subscribe_async(
        self, request_id: str, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop
    ) -> StreamQueue:
        """An asyncio queue on `loop` that receives every output of `request_id` (or what
        ended the engine). Subscribe before the request is admitted so nothing is missed."""
        q = StreamQueue()
        self._subscribe(request_id, prompt_token_ids, loop, q)
        return q

    def subscribe(self, request_id: str, prompt_token_ids: list[int]) -> queue.Queue[Item]:
        """`subscribe_async` for a thread."""
        q: queue.Queue[Item] = queue.Queue()
        self._subscribe(request_id, prompt_token_ids, None, q)
        return q

    def _subscribe(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        loop: asyncio.AbstractEventLoop | None,
        q: asyncio.Queue[Item] | queue.Queue[Item],
    ) -> None:
        assembler = OutputAssembler(request_id, list(prompt_token_ids), self.tokenizer)
        with self._lock:
            self._subs[request_id] = _Subscriber(assembler, loop, q)
            failure = self.failure
        if failure is not None:
            self._deliver({loop: [(q, EngineStopped(f"engine failed: {failure}"))]})

    def unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subs.pop(request_id, None)

    # -- the receiver thread -----------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while True:
                if not self._events.poll(250):
                    if not self.alive:
                        break
                    continue
                event = unpack(self._events.recv())
                kind = event[0]
                if kind == "step":
                    self._on_step(event[1])
                elif kind == "reply":
                    self._on_reply(event[1], event[2], event[3])
                elif kind == "kv" and self.on_kv is not None:
                    self.on_kv(event[1], event[2], event[3])
                elif kind == "progress" and self.on_progress is not None:
                    self.on_progress(event[1])
                elif kind == "failed":
                    self._died(EngineStopped(f"engine failed: {event[1]}"))
                    return
        except zmq.ZMQError:
            if not self._stopping:
                log.exception("engine core event stream failed")
        if not self._stopping:
            self._died(EngineStopped(f"the engine core exited (code {self.exitcode})"))

    def _on_step(self, entries: list[Any]) -> None:
        batches: dict[asyncio.AbstractEventLoop | None, list[tuple[Any, Item]]] = {}
        with self._lock:
            for entry in entries:
                sub = self._subs.get(entry[0])
                if sub is not None:
                    batches.setdefault(sub.loop, []).append((sub.queue, sub.assembler.apply(entry)))
        self._deliver(batches)

    def _on_reply(self, call_id: int, ok: bool, payload: Any) -> None:
        with self._lock:
            future = self._pending.pop(call_id, None)
        if future is None or not future.set_running_or_notify_cancel():
            return
        if ok:
            future.set_result(payload)
        else:
            future.set_exception(error_from_wire(*payload))

    def _died(self, error: BaseException) -> None:
        if self._stopping:
            return
        log.error("%s", error)
        self.failure = error
        self._fail_all(error)
        if self.on_death is not None:
            self.on_death(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            subs = list(self._subs.values())
        for future in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        batches: dict[asyncio.AbstractEventLoop | None, list[tuple[Any, Item]]] = {}
        for sub in subs:
            batches.setdefault(sub.loop, []).append((sub.queue, error))
        self._deliver(batches)

    @staticmethod
    def _deliver(batches: dict[asyncio.AbstractEventLoop | None, list[tuple[Any, Item]]]) -> None:
        for loop, items in batches.items():
            if loop is None:
                for q, item in items:
                    q.put(item)
            else:
                # NOTE: a closed loop raises RuntimeError; nobody waits there any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[Item], Item]]) -> None:
    for q, item in items:
        direct = getattr(q, "direct", None)
        if direct is not None and q.empty():
            try:
                if direct(item):
                    continue
            except Exception:  # noqa: BLE001 - the other streams' outputs still go out
                log.exception("a stream's output could not be handed on directly: queued")
        q.put_nowait(item)
