"""The Generate stream, shaped as OpenAI's responses: chunks of `text_completion` or
`chat.completion.chunk` for server-sent events, or one `text_completion` / `chat.completion`
object gathered from the whole stream; `usage` from the final message; errors in OpenAI's
`{"error": {...}}` shape with the HTTP status of their gRPC code.

A chat with tools runs each sample's text through its own tool-call parser (`tool_parsers.py`):
streamed, as `delta.content` and `delta.tool_calls` entries (index, id, type and name first,
then fragments of the arguments); gathered, as `message.content` and `message.tool_calls`. A
sample that called a tool and stopped finishes with `tool_calls`. `echo` (completions) puts the
prompt's text before each sample's."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.gateway.tool_call_scanner import ArgsDelta, CallStart, Content, Event
from splitserve.gateway.tool_choice import ToolPlan
from splitserve.gateway.tool_parsers import ToolCallParser, parse
from splitserve.protos.v1 import common_pb2, gateway_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def error_body(code: grpc.StatusCode, message: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error object) for a request that ended with gRPC status `code`."""
    status, kind = HTTP_STATUS.get(code, (500, "internal_server_error"))
    return status, {
        "error": {"message": message, "type": kind, "param": None, "code": code.name.lower()}
    }


# NOTE: JSON leaves these raw inside strings, but clients that split a stream with Python's
# `str.splitlines` (httpx's `aiter_lines`, for one) break an event's line at each of them.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line. The JSON is UTF-8 on one line
    by every line-splitting rule (characters that some treat as a line break are escaped)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n".encode()


def usage(msg: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": msg.prompt_tokens,
        "completion_tokens": msg.completion_tokens,
        "total_tokens": msg.prompt_tokens + msg.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": msg.cached_prompt_tokens},
    }


@dataclass
class Shaper:
    """Turns one request's Generate messages into OpenAI chunks or one final object.

    `chat` picks the chat shapes; `top_logprobs` is how many alternatives each logprobs entry
    lists; `token_text` turns a token id into its text (the model's tokenizer); `tools` is a
    chat's tool plan and `parser` the gateway's tool-call parser (resolved); `echo` the prompt's
    text, put before each completion's."""

    model: str
    chat: bool
    n: int
    top_logprobs: int | None
    token_text: Any
    tools: ToolPlan | None = None
    parser: str = "hermes"
    echo: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _texts: dict[int, list[str]] = field(default_factory=dict)
    _logprobs: dict[int, list[common_pb2.TokenLogprobs]] = field(default_factory=dict)
    _started: set[int] = field(default_factory=set)
    _parsers: dict[int, ToolCallParser | None] = field(default_factory=dict)
    _called: set[int] = field(default_factory=set)  # samples that began a tool call

    @property
    def object_id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}"

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.object_id,
            "object": f"{kind}.chunk" if stream and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # -- streaming ---------------------------------------------------------------------------

    def chunk(self, delta: common_pb2.SampleDelta) -> dict[str, Any] | None:
        """The chunk for new tokens of one sample (None: nothing to send yet, all of it held
        back by the sample's tool-call parser)."""
        logprobs = self._logprobs_json(list(delta.logprobs)) if delta.logprobs else None
        if self.chat:
            parser = self._parser(delta.index)
            if parser is None:
                message: dict[str, Any] = {"content": delta.text}
            else:
                message = self._tool_delta(delta.index, parser.feed(delta.text))
                if not message and logprobs is None:
                    return None
            if delta.index not in self._started:
                self._started.add(delta.index)
                message = {"role": "assistant", **message}
            choice: dict[str, Any] = {"index": delta.index, "delta": message}
        else:
            text = delta.text
            if delta.index not in self._started:
                self._started.add(delta.index)
                text = self.echo + text
            choice = {"index": delta.index, "text": text}
        choice.update(logprobs=logprobs, finish_reason=None)
        return self._envelope([choice], stream=True)

    def final_chunks(self, finished: gateway_pb2.Finished) -> list[dict[str, Any]]:
        """A last chunk per sample, carrying its finish_reason (and what its tool-call parser
        held back to the end)."""
        chunks = []
        for sample in finished.samples:
            if self.chat:
                parser = self._parser(sample.index)
                delta = self._tool_delta(sample.index, parser.finish()) if parser else {}
                if sample.index not in self._started:
                    delta = {"role": "assistant", **delta}
                choice: dict[str, Any] = {"index": sample.index, "delta": delta}
            else:
                text = "" if sample.index in self._started else self.echo
                choice = {"index": sample.index, "text": text}
            choice.update(logprobs=None, finish_reason=self._finish(sample))
            chunks.append(self._envelope([choice], stream=True))
        return chunks

    def usage_chunk(self, finished: gateway_pb2.Finished) -> dict[str, Any]:
        return {**self._envelope([], stream=True), "usage": usage(finished.usage)}

    # -- one response ------------------------------------------------------------------------

    def add(self, delta: common_pb2.SampleDelta) -> None:
        """Gather a chunk for `response`."""
        self._texts.setdefault(delta.index, []).append(delta.text)
        self._logprobs.setdefault(delta.index, []).extend(delta.logprobs)

    def response(self, finished: gateway_pb2.Finished) -> dict[str, Any]:
        choices = []
        for sample in sorted(finished.samples, key=lambda s: s.index):
            text = "".join(self._texts.get(sample.index, []))
            entries = self._logprobs.get(sample.index, [])
            logprobs = self._logprobs_json(entries) if self.top_logprobs is not None else None
            if self.chat:
                message = self._message(sample.index, text)
                choice: dict[str, Any] = {"index": sample.index, "message": message}
            else:
                choice = {"index": sample.index, "text": self.echo + text}
            choice.update(logprobs=logprobs, finish_reason=self._finish(sample))
            choices.append(choice)
        return {**self._envelope(choices, stream=False), "usage": usage(finished.usage)}

    # -- tool calls --------------------------------------------------------------------------

    def _parser(self, index: int) -> ToolCallParser | None:
        if index not in self._parsers:
            self._parsers[index] = self.tools.parser(self.parser) if self.tools else None
        return self._parsers[index]

    def _tool_delta(self, index: int, events: list[Event]) -> dict[str, Any]:
        """A chat delta from a parser's events: `content`, and `tool_calls` entries."""
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls: dict[int, dict[str, Any]] = {}
        for event in events:
            if isinstance(event, Content) or not self._allowed(event.index):
                continue
            if isinstance(event, CallStart):
                self._called.add(index)
                calls[event.index] = {
                    "index": event.index,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            elif isinstance(event, ArgsDelta):
                entry = calls.setdefault(
                    event.index, {"index": event.index, "function": {"arguments": ""}}
                )
                entry["function"]["arguments"] += event.text
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [calls[i] for i in sorted(calls)]
        return delta

    def _allowed(self, call_index: int) -> bool:
        """parallel_tool_calls false keeps a sample's first call only."""
        return self.tools is None or self.tools.parallel or call_index == 0

    def _message(self, index: int, text: str) -> dict[str, Any]:
        parser = self._parser(index)
        if parser is None:
            return {"role": "assistant", "content": text}
        parsed = parse(parser, text)
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for i, call in enumerate(parsed.tool_calls)
            if self._allowed(i)
        ]
        if not calls:
            return {"role": "assistant", "content": parsed.content}
        self._called.add(index)
        return {"role": "assistant", "content": parsed.content, "tool_calls": calls}

    def _finish(self, sample: common_pb2.SampleFinish) -> str | None:
        reason = _finish(sample)
        return "tool_calls" if reason == "stop" and sample.index in self._called else reason

    # -- logprobs ----------------------------------------------------------------------------

    def _logprobs_json(self, entries: list[common_pb2.TokenLogprobs]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        k = self.top_logprobs
        if self.chat:
            return {
                "content": [
                    {
                        **self._token(e.token_id, e.logprob),
                        "top_logprobs": [self._token(t.token_id, t.logprob) for t in e.top[:k]],
                    }
                    for e in entries
                ]
            }
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                {self.token_text(t.token_id): t.logprob for t in e.top[:k]} for e in entries
            ],
            "text_offset": offsets,
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _finish(sample: common_pb2.SampleFinish) -> str | None:
    return FINISH_REASONS.get(sample.finish_reason)
