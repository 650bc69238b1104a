"""A service's life: LOADING -> SERVING -> DRAINING, with grpc.health.v1 following it.

    start gRPC server (health NOT_SERVING; every method answers UNAVAILABLE "loading")
    load the engine, bind the real servicers, join the registry      -> SERVING
    SIGTERM: leave the registry, refuse new work (UNAVAILABLE "draining"),
             finish what is in flight (up to --drain-timeout-s)       -> NOT_SERVING, exit 0

gRPC needs its servicers before the server starts, so each service is registered through a
`GatedServicer` that stands in for the real one until `bind`, and that also counts the calls in
flight (coroutines and async generators on the server's event loop) so that draining knows when
it is done.
"""

from __future__ import annotations

import enum
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from splitserve.engine.errors import Unavailable
from splitserve.runtime.grpc_server import Server

log = logging.getLogger(__name__)


class State(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"


class Lifecycle:
    """The state of one service process and its health; counts calls in flight."""

    def __init__(self, service_names: Collection[str]) -> None:
        self.server: Server | None = None  # attached once started (it needs the gates first)
        self.service_names = ["", *service_names]
        self.state = State.LOADING
        self._inflight = 0
        self._lock = threading.Lock()
        self._pending: list[Callable[[], int]] = []

    def gate(self, admitting: Collection[str] = ()) -> GatedServicer:
        """A stand-in servicer; methods named in `admitting` take new work and are refused
        while draining (the others, e.g. a decode stream already reserved, go on)."""
        return GatedServicer(self, frozenset(admitting))

    def also_wait_for(self, pending: Callable[[], int]) -> None:
        """Work that is no call in flight but must finish before exit (e.g. reservations)."""
        self._pending.append(pending)

    def attach(self, server: Server) -> None:
        self.server = server

    def set_serving(self) -> None:
        self.state = State.SERVING
        if self.server is not None:
            self.server.set_serving(True, self.service_names)

    def start_draining(self) -> None:
        self.state = State.DRAINING
        if self.server is not None:
            self.server.set_serving(False, self.service_names)

    def check_admitting(self) -> None:
        if self.state is not State.SERVING:
            raise Unavailable(self.state.value)

    def num_busy(self) -> int:
        with self._lock:
            inflight = self._inflight
        return inflight + sum(pending() for pending in self._pending)

    def wait_idle(self, timeout_s: float, interrupt: threading.Event | None = None) -> bool:
        """Wait until nothing is in flight; False if `timeout_s` passed (or `interrupt` was set)
        first."""
        deadline = time.monotonic() + timeout_s
        while (busy := self.num_busy()) > 0:
            if time.monotonic() >= deadline or (interrupt is not None and interrupt.is_set()):
                log.warning("stopping with %d call(s) or request(s) still in flight", busy)
                return False
            time.sleep(0.05)
        return True

    def enter(self) -> None:
        with self._lock:
            self._inflight += 1

    def exit(self) -> None:
        with self._lock:
            self._inflight -= 1


# Calls that carry other calls' work and stay open while idle (a gateway keeps one DecodeMany
# call per decode worker): not counted in flight, or a drain would wait for them to its timeout;
# the work they carry is (a decode worker's drain waits for its streams, `Served.pending`).
CARRIERS = frozenset({"DecodeMany"})


class GatedServicer:
    """Forwards every RPC method to the servicer given to `bind`; until then each answers
    UNAVAILABLE "loading". Registered in place of the real servicer.

    A forwarded call is a coroutine (unary responses) or an async generator (a stream), after
    the bound method; the server's interceptor awaits or iterates whichever it gets. Plain
    methods and generators of a bound servicer work too (run on the caller's loop)."""

    def __init__(self, lifecycle: Lifecycle, admitting: frozenset[str]) -> None:
        self._lifecycle = lifecycle
        self._admitting = admitting
        self._target: Any = None

    def bind(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, method: str) -> Callable[[Any, Any], Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        admitting = method in self._admitting

        def call(request: Any, context: Any) -> Any:
            target = self._target
            if target is None:
                raise Unavailable(State.LOADING.value)
            handler = getattr(target, method)
            if method in CARRIERS:
                return handler(request, context)
            if inspect.isasyncgenfunction(handler) or inspect.isgeneratorfunction(handler):
                return self._stream(handler, admitting, request, context)
            return self._unary(handler, admitting, request, context)

        return call

    async def _unary(self, handler: Callable, admitting: bool, request: Any, context: Any) -> Any:
        self._lifecycle.enter()
        try:
            if admitting:
                self._lifecycle.check_admitting()
            result = handler(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        finally:
            self._lifecycle.exit()

    async def _stream(
        self, handler: Callable, admitting: bool, request: Any, context: Any
    ) -> AsyncIterator[Any]:
        # NOTE: counted before the admission check, so that draining never misses a call that
        # passed it; and only from the first message on: a stream never started counts nothing.
        self._lifecycle.enter()
        responses = None
        try:
            if admitting:
                self._lifecycle.check_admitting()
            responses = handler(request, context)
            if inspect.isasyncgen(responses):
                async for response in responses:
                    yield response
            else:
                for response in responses:
                    yield response
        finally:
            if inspect.isasyncgen(responses):
                await responses.aclose()  # NOTE: the handler's cleanup runs before the count
            self._lifecycle.exit()
