"""The HTTP API's conveniences beside OpenAI's endpoints, in vLLM's shapes.

    POST /tokenize     {"prompt": text, "add_special_tokens": true}  or
                       {"messages": [...], "add_generation_prompt": true, "tools": [...]}
                       -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize   {"tokens": [ids]} -> {"prompt": text}
    GET  /version      {"version": the installed splitserve's}
    GET  /metrics      the gateway's Prometheus registry, as its --metrics-port serves it

A conversation is rendered exactly as /v1/chat/completions renders it (tools included), so
/tokenize counts the prompt tokens a chat request will use. Tokenizing runs in a thread (a
long text would stall every stream on the loop). /version is open like /health; the rest
check the caller's credentials as the OpenAI endpoints do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from splitserve.engine.errors import InvalidRequest, NotFound, SplitserveError
from splitserve.gateway.http_models import ChatCompletionRequest, tool_messages
from splitserve.gateway.tool_chat import render_with_tools
from splitserve.gateway.tool_choice import plan_tools


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a prompt, or a conversation (with tools, if any)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # a prompt: true; a conversation: false (as vLLM)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def version() -> str:
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def add_extra_routes(
    app: FastAPI,
    tokenizer: Any,
    info: Any,
    identity: Callable[[Request], AbstractContextManager[Any]],
    error: Callable[[BaseException], JSONResponse],
    registry: Any,
    parser_kind: str,
) -> None:
    """Add /tokenize, /detokenize, /version and /metrics to `app`. `identity` checks a
    request's credentials; `error` answers an exception in OpenAI's shape."""

    def failed(exc: Exception) -> JSONResponse:
        """A domain error as its status; any other bad value (a malformed message) as a 400."""
        if isinstance(exc, ValueError) and not isinstance(exc, SplitserveError):
            exc = InvalidRequest(str(exc))
        return error(exc)

    def check(request: Request, model: str | None) -> None:
        with identity(request):
            pass
        if model not in (None, "", info.name):
            raise NotFound(f"the model {model!r} does not exist; this serves {info.name!r}")

    def tokenize_sync(body: TokenizeRequest) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("send either `prompt` or `messages`")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return list(tokenizer.encode(body.prompt, add_special_tokens=special))
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)  # type: ignore[arg-type]
        plan = plan_tools(body.tools, None, None)
        return render_with_tools(
            tokenizer,
            tool_messages(chat),
            plan.tools if plan is not None else (),
            parser_kind,
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=bool(body.add_special_tokens),
        )

    @app.post("/tokenize")
    async def tokenize(request: Request, body: TokenizeRequest) -> Response:
        try:
            check(request, body.model)
            ids = await asyncio.to_thread(tokenize_sync, body)
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            return failed(exc)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
             "token_strs": strs}
        )  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: Request, body: DetokenizeRequest) -> Response:
        try:
            check(request, body.model)
            vocab = info.config.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"tokens outside the vocabulary [0, {vocab}): {bad[:5]}")
            text = await asyncio.to_thread(
                tokenizer.decode, body.tokens, clean_up_tokenization_spaces=False
            )
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            return failed(exc)
        return JSONResponse({"prompt": text})

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse({"version": version()})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            check(request, None)
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            return error(exc)
        body = generate_latest(registry if registry is not None else REGISTRY)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
