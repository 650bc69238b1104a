"""The engine core's side of the door: runs in the core process, answers the front's commands
and streams every step's new tokens to it.

The engine loop is a busy loop on a thread of its own (`EngineLoop`); this module's main thread
only reads commands and hands them on: an engine command is queued for the engine thread and
answered from there when it has run, a command that waits (KV landing, a whole prefill) runs on
a thread of its own. Nothing here serves gRPC streams or detokenizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from splitserve.engine.outputs import RequestOutput
from splitserve.runtime.engine_core.protocol import STOP, StepEncoder, error_to_wire, pack, unpack
from splitserve.runtime.gc_heap import settle

if TYPE_CHECKING:
    from splitserve.engine.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class Emitter:
    """The core's one ordered event stream to its front (safe from any thread)."""

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self._lock = threading.Lock()
        self.encoder = StepEncoder()

    def send(self, event: list[Any]) -> None:
        data = pack(event)
        with self._lock:
            self._socket.send(data, copy=False)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs (on the engine thread): one message for all of them."""
        self.send(["step", self.encoder.encode(outputs)])

    def kv(self, num_bytes: int, seconds: float | None, ok: bool) -> None:
        self.send(["kv", num_bytes, seconds, ok])


@dataclass(frozen=True)
class Command:
    """A method of the closed vocabulary: `fn(*args)` returns a value or a Future; `waits`
    runs it on a thread of its own (it may block)."""

    fn: Callable[..., Any]
    waits: bool = False


class CoreHandler(ABC):
    """One worker role's commands, on the core side."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """What the front needs to know once (limits, transports, endpoints)."""

    @abstractmethod
    def commands(self) -> dict[str, Command]: ...

    @abstractmethod
    def close(self) -> None:
        """Stop transports and threads before the engine stops."""


Build = Callable[[Emitter], tuple["EngineLoop", CoreHandler]]


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (the front) dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve(build: Build, command_address: str, event_address: str, own_process: bool) -> None:
    """Build the engine and the role's handler, then answer commands until told to stop, the
    engine fails, or (in a process of its own) the front goes away."""
    parent = os.getppid()
    if own_process:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: the front decides when to stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 2000)
    events.connect(event_address)
    commands_in = ctx.socket(zmq.PULL)
    commands_in.setsockopt(zmq.LINGER, 0)
    commands_in.connect(command_address)
    emitter = Emitter(events)
    try:
        loop, handler = build(emitter)
    except BaseException as exc:  # noqa: BLE001 - the front reports it and exits
        log.exception("engine core failed to start")
        emitter.send(["failed", str(exc), type(exc).__name__])
        events.close()
        commands_in.close()
        ctx.term()
        return
    pauses = settle("engine core") if own_process else None
    emitter.send(["ready", handler.info()])
    table = handler.commands()
    try:
        while loop.running:
            if own_process and os.getppid() != parent:
                log.error("the front process is gone; the engine core exits")
                break
            if not commands_in.poll(500):
                continue
            call_id, method, args = unpack(commands_in.recv())
            if method == STOP:
                break
            _dispatch(emitter, table, call_id, method, args)
    finally:
        handler.close()
        loop.stop()
        events.close()
        commands_in.close()
        ctx.term()
        if pauses is not None:
            pauses.log_summary()


def _dispatch(
    emitter: Emitter, table: dict[str, Command], call_id: int, method: str, args: list[Any]
) -> None:
    command = table.get(method)
    if command is None:
        emitter.send(["reply", call_id, False, ["CoreError", f"no command {method!r}", ""]])
        return

    def run() -> None:
        try:
            result = command.fn(*args)
        except BaseException as exc:  # noqa: BLE001 - answered to the caller
            _reply_error(emitter, call_id, exc)
            return
        if isinstance(result, Future):
            result.add_done_callback(lambda f: _reply_future(emitter, call_id, f))
        else:
            emitter.send(["reply", call_id, True, result])

    if command.waits:
        threading.Thread(target=run, name=f"core-{method}", daemon=True).start()
    else:
        run()


def _reply_future(emitter: Emitter, call_id: int, future: Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        _reply_error(emitter, call_id, exc)
    else:
        emitter.send(["reply", call_id, True, future.result()])


def _reply_error(emitter: Emitter, call_id: int, exc: BaseException) -> None:
    wire = error_to_wire(exc)
    if wire[0] == "CoreError":
        log.error("engine core command failed", exc_info=exc)
    emitter.send(["reply", call_id, False, wire])
