"""The OpenAI-compatible HTTP front door: FastAPI on uvicorn, inside the gateway process.

    POST /v1/completions, /v1/chat/completions ──▶ GenerateRequest ──▶ the Gateway servicer's
    GET /v1/models, /health                          Generate (the gRPC API's own path: the same
                                                     validation, admission, orchestrator, metrics,
                                                     traces and drain accounting)
    POST /tokenize, /detokenize; GET /version, /metrics   (http_extras.py)

uvicorn serves on the gRPC server's own event loop (the "grpc-loop" thread): the orchestrator's
`grpc.aio` channels belong to that loop, so an HTTP request awaits the workers exactly as a gRPC
call does, with no hop between loops or threads. The socket is bound by the caller's thread
(a taken port fails at start, with its error) and handed to uvicorn, which installs no signal
handlers off the main thread.

A client that disconnects cancels its request's task: the orchestrator then aborts it on every
worker it reached, which frees its blocks (`EventStream`, `until_done_or_gone`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from splitserve.engine.errors import InvalidRequest, NotFound
from splitserve.gateway.http_extras import add_extra_routes
from splitserve.gateway.http_models import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    has_tool_messages,
    tool_messages,
    tool_plan,
)
from splitserve.gateway.http_responses import Shaper, error_body, sse
from splitserve.gateway.tool_chat import render_with_tools, template_text
from splitserve.gateway.tool_parsers import resolve_parser
from splitserve.protos.v1 import gateway_pb2
from splitserve.runtime.grpc_server import Server, status_for

log = logging.getLogger(__name__)
T = TypeVar("T")
Authorize = Callable[[Mapping[str, str]], AbstractContextManager[Any]]


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class HttpCall:
    """What the Gateway servicer asks of a call (grpc's ServicerContext surface it uses), for
    an HTTP request: its trace headers, no deadline, and whether the client is gone."""

    def __init__(self, headers: Any) -> None:
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self.gone = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def done(self) -> bool:
        return self.gone

    def cancelled(self) -> bool:
        return self.gone


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_done_or_gone(request: Request, call: HttpCall, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        call.gone = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # NOTE: its abort runs to the end
        raise ClientGone
    return task.result()


class EventStream(StreamingResponse):
    """A `text/event-stream` response whose producer is cancelled when the client goes away
    (so the request is aborted on the workers at once, not at its next token)."""

    def __init__(self, events: AsyncIterator[bytes], call: HttpCall) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.events = events
        self.call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def pump() -> None:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({producer, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not producer.done():
                self.call.gone = True
            for task in (producer, watch):
                task.cancel()
            await asyncio.gather(producer, watch, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]


def create_app(generate: Callable[[gateway_pb2.GenerateRequest, HttpCall], Any], info: Any,
               tokenizer: Any, is_serving: Callable[[], bool],
               authorize: Authorize | None = None, tool_call_parser: str = "auto",
               metrics_registry: Any = None,
               adapters: Callable[[], Iterable[str]] | None = None,
               lora_admin: Any = None) -> FastAPI:  # fmt: skip
    """The app. `generate(request, call)` is the Gateway servicer's Generate (through its
    lifecycle gate); `info` the served model (`ModelInfo`). `authorize(headers)`, when given,
    checks a request's credentials before anything else (raising a domain error, e.g.
    UNAUTHENTICATED, answered as such) and returns the context to serve it in (the caller's
    identity); `/health` and `/version` stay open. `tool_call_parser` reads tool calls out of
    the model's text (`auto`: picked from the chat template); `metrics_registry` is the
    Prometheus registry `GET /metrics` serves (None: the process's default one);
    `adapters()` the LoRA adapters live workers serve (blocking: called in a thread), which a
    request's `model` may name and /v1/models lists, each with the base model as its parent;
    `lora_admin` (`lora_admin.AdapterAdmin`) serves vLLM's /v1/load_lora_adapter and
    /v1/unload_lora_adapter (`{"lora_name", "lora_path"}`; 200 and a line of text)."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url=None)
    parser_kind = resolve_parser(tool_call_parser, template_text(tokenizer))

    def identity(request: Request) -> AbstractContextManager[Any]:
        return authorize(request.headers) if authorize else contextlib.nullcontext()

    def token_text(token_id: int) -> str:
        return str(tokenizer.decode([token_id], clean_up_tokenization_spaces=False))

    def error(exc: BaseException) -> JSONResponse:
        code, message = status_for(exc)
        status, body = error_body(code, message)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        status, body = error_body(_invalid(), problems or "invalid request body")
        return JSONResponse(body, status_code=status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if is_serving() else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            identity(request)
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            return error(exc)
        card = {
            "id": info.name,
            "object": "model",
            "created": 0,
            "owned_by": "splitserve",
            "max_model_len": info.max_model_len,
        }
        names = sorted(await asyncio.to_thread(adapters)) if adapters is not None else []
        loras = [{**card, "id": name, "root": name, "parent": info.name} for name in names]
        return JSONResponse({"object": "list", "data": [card, *loras]})

    async def lora(request: Request, load: bool) -> Response:
        try:
            with identity(request):
                body = await request.json()
                if not isinstance(body, dict):
                    raise InvalidRequest("the body must be a JSON object")
                name = body.get("lora_name")
                if load:
                    await lora_admin.load(name, str(body.get("lora_path") or ""))
                else:
                    await lora_admin.unload(name)
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            return error(exc)
        done = "added" if load else "removed"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {done} successfully.")

    if lora_admin is not None:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return await lora(request, load=True)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await lora(request, load=False)

    async def serve(request: Request, body: Any, chat: bool) -> Response:
        try:
            scope = identity(request)
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            return error(exc)
        with scope:  # NOTE: the servicer reads the caller's identity when the request starts
            return await serve_as_caller(request, body, chat)

    async def to_proto(body: Any, chat: bool) -> tuple[gateway_pb2.GenerateRequest, Any]:
        """The GenerateRequest, and the chat's tool plan; a chat with tools is rendered here
        (in a thread: a long conversation would stall every other stream)."""
        proto, plan = await _base_proto(body, chat)
        if body.model not in (None, "", info.name):
            # NOTE: another name is a LoRA adapter's (as in vLLM); the gateway answers NOT_FOUND
            # (404), naming it, when no live worker serves one of that name.
            proto.adapter = body.model
        return proto, plan

    async def _base_proto(body: Any, chat: bool) -> tuple[gateway_pb2.GenerateRequest, Any]:
        if not chat:
            return completion_request(body), None
        plan = tool_plan(body)
        if plan is None and not has_tool_messages(body):
            return chat_request(body), None
        tools = plan.tools if plan is not None else ()
        ids = await asyncio.to_thread(
            render_with_tools, tokenizer, tool_messages(body), tools, parser_kind
        )
        return chat_request(body, plan, ids, info.max_model_len), plan

    def echo_text(proto: gateway_pb2.GenerateRequest) -> str:
        if proto.WhichOneof("prompt") == "text":
            return proto.text
        return str(tokenizer.decode(list(proto.token_ids.ids), clean_up_tokenization_spaces=False))

    async def serve_as_caller(request: Request, body: Any, chat: bool) -> Response:
        try:
            proto, plan = await to_proto(body, chat)
        except ValueError as exc:  # InvalidRequest, and protobuf's out-of-range values
            status, payload = error_body(_invalid(), str(exc))
            return JSONResponse(payload, status_code=status)
        except NotFound as exc:
            return error(exc)
        top = proto.sampling.logprobs if proto.sampling.HasField("logprobs") else None
        echo = echo_text(proto) if not chat and body.echo else ""
        shaper = Shaper(info.name, chat, body.n, top, token_text, plan, parser_kind, echo)
        call = HttpCall(request.headers)
        responses = generate(proto, call)
        try:
            if body.stream:
                first = await until_done_or_gone(request, call, anext(responses))
                return EventStream(_events(shaper, first, responses, body.include_usage), call)
            return await until_done_or_gone(request, call, _gather(shaper, responses))
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure is answered in OpenAI's shape
            await responses.aclose()
            return error(exc)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await serve(request, body, chat=True)

    add_extra_routes(app, tokenizer, info, identity, error, metrics_registry, parser_kind)
    return app


async def _gather(shaper: Shaper, responses: Any) -> JSONResponse:
    async for msg in responses:
        if msg.HasField("chunk"):
            shaper.add(msg.chunk)
        else:
            return JSONResponse(shaper.response(msg.finished))
    raise RuntimeError("the Generate stream ended without its final message")


async def _events(
    shaper: Shaper, first: gateway_pb2.GenerateResponse, responses: Any, include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per message, a last chunk per sample, usage if asked, [DONE]. A
    failure after the first message is sent as an error event (the status is already 200)."""
    try:
        msg: gateway_pb2.GenerateResponse | None = first
        while msg is not None:
            if msg.HasField("chunk"):
                chunk = shaper.chunk(msg.chunk)
                if chunk is not None:
                    yield sse(_with_usage(chunk, include_usage))
            else:
                for chunk in shaper.final_chunks(msg.finished):
                    yield sse(_with_usage(chunk, include_usage))
                if include_usage:
                    yield sse(shaper.usage_chunk(msg.finished))
            msg = await anext(responses, None)
    except Exception as exc:  # noqa: BLE001 - sent to the client as OpenAI's error event
        yield sse(error_body(*status_for(exc))[1])
    finally:
        await responses.aclose()
    yield sse("[DONE]")


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    return {**chunk, "usage": None} if include_usage else chunk


def _invalid() -> grpc.StatusCode:
    return grpc.StatusCode.INVALID_ARGUMENT


class HttpFrontDoor:
    """uvicorn serving `app` on the gRPC server's event loop (see the module docstring)."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        reuse_port: bool = False,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # NOTE: one of `--processes N`: the parent checked the port was free
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise ValueError(f"--http-port: can't listen on {host}:{port}: {exc}") from None
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        if ssl_context is not None:
            # NOTE: HTTPS only on this port (a plaintext request fails its handshake): the
            # context is set on the loaded config, as uvicorn's own ssl_* options would.
            config.load()
            config.ssl = ssl_context
        self._uvicorn = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    def start(self, server: Server) -> None:
        server.run(self._start())

    async def _start(self) -> None:
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[self._socket]))
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    def stop(self, server: Server) -> None:
        """Stop listening and end the connections left (after a drain there are none)."""
        if self._task is not None:
            server.run(self._stop(), timeout_s=15.0)
        self._socket.close()

    async def _stop(self) -> None:
        self._uvicorn.should_exit = True
        assert self._task is not None
        try:
            await asyncio.wait_for(self._task, 10.0)
        except Exception:  # noqa: BLE001 - stopping goes on
            log.exception("the HTTP server did not stop cleanly")
