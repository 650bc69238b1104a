"""What every splitserve gRPC server shares: an asyncio server on an event loop of its own,
health, reflection, and one interceptor that maps exceptions to status codes, so servicers stay
thin (protobuf -> domain -> engine -> protobuf).

    main thread ── start_server / set_serving / stop ──run_coroutine_threadsafe──┐
                                                                                 ▼
    "grpc-loop" thread: asyncio loop ── grpc.aio server ── handlers (coroutines, async generators)
                              └── default executor ("grpc-blocking" threads): blocking work the
                                  handlers hand off with `asyncio.to_thread` (Redis, copies)

A waiting stream holds no thread: a server holds as many calls as its handlers admit. The rest
of a service process stays synchronous; only the handlers run on the loop, and they must never
block it (engine calls go through `EngineCoreClient.acall`, blocking calls through threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.engine.errors import SplitserveError, clip
from splitserve.runtime import loop_lag

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
DEFAULT_BLOCKING_THREADS = 256
# NOTE: gRPC binds with SO_REUSEPORT by default: a second server on a port in use would then
# start too and split the traffic. Off, it fails at start (BindError) instead. Only the
# processes of one `splitserve gateway --processes N` turn it on, after their parent checked
# that nobody else holds the port (splitserve/launch/gateway_processes.py).
NO_REUSEPORT = ("grpc.so_reuseport", 0)
REUSEPORT = ("grpc.so_reuseport", 1)


class BindError(OSError):
    """A server could not listen on its address (in use, or not this host's)."""


def bind(
    server: grpc.Server | grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Listen on host:port (port 0: a free one), with TLS when given `credentials`; the bound
    port, or BindError."""
    try:
        if credentials is not None:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise BindError(
            f"cannot listen on {host}:{port}: the address is in use (another server on this "
            "port?) or not an address of this host"
        )
    return int(bound)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client should see for `exc`.

    Domain errors (`engine.errors`) carry their status; a worker's status met on a call the
    handler made (a `grpc.RpcError`, `grpc.aio.AioRpcError` included) is passed on as it came.
    Anything else is a bug here, not the caller's fault: INTERNAL. The message is clipped to
    under 1 KiB, whatever it echoes of the request (a client's trailers are limited).
    """
    if isinstance(exc, SplitserveError):
        return grpc.StatusCode[exc.status], clip(str(exc))
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return exc.code(), clip(exc.details() or str(exc))  # type: ignore[attr-defined]
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Turns any exception a handler raises into `context.abort(code, message)`.

    Works for handlers that are coroutines, async generators or plain functions (called on the
    loop: fine for trivial ones only). A cancelled call (the client went away, its deadline
    passed, the server stops) raises `asyncio.CancelledError`, which passes through unlogged.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
        return handler


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    # NOTE: context.abort() ends a handler by raising AbortError; a finished call (or a
    # stopping server) has nothing left to tell the client: let those through as they are.
    if isinstance(exc, grpc.aio.BaseError) or context.done():
        raise exc
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("handler failed", exc_info=exc)
    await context.abort(code, message)


def _wrap_unary(fn: Callable) -> Callable:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = fn(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        except Exception as exc:
            await _abort(context, exc)

    return wrapper


def _wrap_stream(fn: Callable) -> Callable:
    # NOTE: a coroutine that writes each response itself (grpc's reader/writer API) rather than
    # an async generator that grpc iterates: a cancel that lands while a response is written
    # then ends here too, and the handler's generators are closed (their cleanup run: abort the
    # request, free its blocks) at once, not whenever the garbage collector finds them.
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> None:
        responses: Any = None
        try:
            responses = fn(request, context)
            if inspect.isawaitable(responses):  # a reader/writer handler: it writes itself
                await responses
            elif hasattr(responses, "__aiter__"):
                async for response in responses:
                    await context.write(response)
            elif responses is not None:
                for response in responses:
                    await context.write(response)
        except Exception as exc:
            await _abort(context, exc)
        finally:
            if inspect.isasyncgen(responses):
                await responses.aclose()

    return wrapper


class Server:
    """A started server: its bound port, its health, and the loop it runs on.

    Every method is for the main thread (or any thread but the loop's own)."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        health_servicer: Any,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        executor: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.loop = loop
        self._thread = thread
        self._executor = executor
        self._stop_hooks: list[Callable[[], Awaitable[Any]]] = []
        self._stopped = False
        self._background: set[asyncio.Task[None]] = set()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = 30.0) -> T:
        """Run `coro` on the server's loop and wait for its result."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def set_serving(self, serving: bool, services: Iterable[str] = ("",)) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        names = list(services)

        async def flip() -> None:
            for name in names:
                await _maybe_await(self.health.set(name, status))

        if threading.current_thread() is self._thread:  # from a handler: no waiting on itself
            task = self.loop.create_task(flip())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        else:
            self.run(flip())

    def on_stop(self, hook: Callable[[], Awaitable[Any]]) -> None:
        """Await `hook()` on the loop once the server has stopped (e.g. to close aio channels
        the handlers used), before the loop ends."""
        self._stop_hooks.append(hook)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (calls still running get `grace_s`, then are cancelled), then the loop."""
        if self._stopped:
            return
        self._stopped = True

        async def shutdown() -> None:
            await _maybe_await(self.health.enter_graceful_shutdown())
            await self.server.stop(grace_s)
            for hook in self._stop_hooks:
                try:
                    await hook()
                except Exception:  # noqa: BLE001 - the other hooks and the loop still stop
                    log.exception("stop hook failed")

        try:
            self.run(shutdown(), timeout_s=grace_s + 30.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30.0)
            self._executor.shutdown(wait=False, cancel_futures=True)


async def _maybe_await(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    host: str = "127.0.0.1",
    port: int = 0,
    blocking_threads: int = DEFAULT_BLOCKING_THREADS,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    reuse_port: bool = False,
) -> Server:
    """Start a `grpc.aio` server on a new event loop thread, with health (NOT_SERVING until
    `set_serving`) and reflection; `register` adds the servicers (on the loop's thread).

    Port 0 picks a free port; the bound one is returned. `blocking_threads` bounds the loop's
    default executor, where handlers run what blocks (`asyncio.to_thread`). `interceptors`
    run inside the status interceptor (an authentication check's error becomes its status);
    `credentials` serve TLS. `reuse_port`: share the port with the other processes of one
    gateway (SO_REUSEPORT; see NO_REUSEPORT).
    """
    names = list(service_names)
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(
        blocking_threads, thread_name_prefix="grpc-blocking"
    )
    loop.set_default_executor(executor)
    started: concurrent.futures.Future[tuple[grpc.aio.Server, int, Any]] = (
        concurrent.futures.Future()
    )

    async def start() -> tuple[grpc.aio.Server, int, Any]:
        server = grpc.aio.server(
            interceptors=[StatusInterceptor(), *interceptors],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                REUSEPORT if reuse_port else NO_REUSEPORT,
            ],
        )
        register(server)
        health_servicer = health.aio.HealthServicer()  # grpcio-health-checking >= 1.32
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        for name in ["", *names]:
            await _maybe_await(
                health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            )
        bound = bind(server, host, port, credentials)
        await server.start()
        loop_lag.start(names[0] if names else "grpc server")
        return server, bound, health_servicer

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            started.set_result(loop.run_until_complete(start()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            started.set_exception(exc)
            loop.close()
            return
        try:
            loop.run_forever()
        finally:
            _close(loop)

    thread = threading.Thread(target=run, name="grpc-loop", daemon=True)
    thread.start()
    try:
        server, bound, health_servicer = started.result()
    except BaseException:
        thread.join(5.0)
        executor.shutdown(wait=False)
        raise
    return Server(server, bound, health_servicer, loop, thread, executor)


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """End what is left on a stopped loop (tasks of cancelled calls, async generators)."""
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=5.0))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except Exception:  # noqa: BLE001 - the loop closes either way
        log.exception("closing the gRPC event loop")
    finally:
        loop.close()
