"""The OpenAI-compatible request bodies (pydantic) and how each becomes a `GenerateRequest`.

The HTTP front door takes these, turns them into the same `GenerateRequest` the gRPC API takes,
and hands that to the same servicer: one path from a request to the workers. Field names and
meanings are OpenAI's, plus vLLM's sampling extras (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, `stop_token_ids`) for clients that send them. Fields a client may
send that change nothing here (`user`, `store`, `metadata`, …) are accepted and ignored; fields
whose meaning can't be honoured (`suffix`, `best_of`, `logit_bias`, `echo` with `logprobs`) are
refused with a 400 rather than silently dropped. A chat with tools (`tools`, `tool_choice`,
`parallel_tool_calls`, `tool` messages, assistant `tool_calls`) is planned by `tool_choice.py`
and rendered by `tool_chat.py`: the HTTP layer then hands the servicer its prompt token ids.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.engine.errors import InvalidRequest
from splitserve.gateway.coalesce import check_stream_interval_ms
from splitserve.gateway.structured_openai import structured_from_openai as structured_spec
from splitserve.gateway.tool_choice import ToolPlan, plan_tools
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, gateway_pb2

# Request fields that ask for structured outputs (OpenAI's and vLLM's names).
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat share: OpenAI's sampling fields, vLLM's extras, structured
    output fields (handed to `structured_from_openai`)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    # splitserve's extension: tokens per streamed chunk (GenerateRequest.stream_interval)
    stream_interval: int | None = None
    # splitserve's extension: ms between streamed chunks at least (GenerateRequest's)
    stream_interval_ms: int | None = None
    # structured outputs
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """An earlier tool call of the assistant, in a message sent back."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def completion_request(body: CompletionRequest) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for a completions body; InvalidRequest names what can't be served."""
    _refuse(suffix=body.suffix, best_of=body.best_of not in (None, body.n))
    if body.echo and body.logprobs is not None:
        raise InvalidRequest("echo with logprobs is not supported (prompt logprobs aren't kept)")
    request = gateway_pb2.GenerateRequest(sampling=_sampling(body, body.max_tokens))
    _set_stream_interval(body, request)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(t, int) for t in prompt):
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    elif not prompt:
        raise InvalidRequest("prompt is empty")
    else:
        raise InvalidRequest("prompt: one prompt per request (a string or a list of token ids)")
    if body.logprobs is not None:
        request.sampling.logprobs = body.logprobs
    structured_from_openai(body, request)
    return request


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """What the body's tool fields ask for (None: no tools); InvalidRequest for a bad one."""
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if plan is not None and plan.choice != "none":
        asked = body.model_dump(include=set(STRUCTURED_FIELDS), exclude_none=True)
        if structured_spec(asked) is not None:
            raise InvalidRequest(
                f"tools with tool_choice {plan.choice!r} and a structured output "
                f"({', '.join(asked)}) can't be combined; send one, or tool_choice 'none'"
            )
    return plan


def has_tool_messages(body: ChatCompletionRequest) -> bool:
    """Whether the conversation holds tool results or the assistant's earlier calls."""
    return any(m.role == "tool" or m.tool_calls for m in body.messages)


def tool_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as `tool_chat.render_with_tools` takes them: text content, each earlier
    call's arguments as an object, each tool result named after the call it answers."""
    names: dict[str, str] = {}
    out = []
    for i, message in enumerate(body.messages):
        item: dict[str, Any] = {"role": message.role, "content": _text(message)}
        calls = []
        for j, call in enumerate(message.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise InvalidRequest(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object"
                )
            names[call.id] = call.function.name
            calls.append({"id": call.id, "name": call.function.name, "arguments": arguments})
        if calls:
            item["tool_calls"] = calls
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id or ""
            item["name"] = message.name or names.get(message.tool_call_id or "", "")
        out.append(item)
    return out


def chat_request(
    body: ChatCompletionRequest,
    plan: ToolPlan | None = None,
    prompt_ids: list[int] | None = None,
    max_model_len: int = 0,
) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for a chat body: its messages, rendered by the gateway with the
    model's chat template; or, for a chat with tools, `prompt_ids` (rendered already, with
    `plan`'s tools) and the grammar `plan` forces, if any."""
    both = body.max_tokens is not None and body.max_completion_tokens is not None
    if both and body.max_tokens != body.max_completion_tokens:
        raise InvalidRequest("max_tokens and max_completion_tokens disagree; send one")
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    if prompt_ids is not None and max_tokens is None:  # a chat reply runs to the context's end
        max_tokens = max(1, max_model_len - len(prompt_ids))
    request = gateway_pb2.GenerateRequest(sampling=_sampling(body, max_tokens))
    _set_stream_interval(body, request)
    if prompt_ids is not None:
        request.token_ids.ids.extend(prompt_ids)
    else:
        for message in body.messages:
            request.messages.messages.add(role=message.role, content=_text(message))
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true")
    if body.logprobs:
        request.sampling.logprobs = body.top_logprobs or 0
    if plan is not None and plan.structured is not None:
        convert.structured_to_proto(plan.structured, request.sampling)
    else:
        structured_from_openai(body, request)
    return request


def structured_from_openai(body: _Sampling, request: gateway_pb2.GenerateRequest) -> None:
    """Structured outputs (`response_format`, `guided_*`, `structured_outputs`) onto `request`.

    NOTE: the one seam for constrained decoding: the grammar spec is built here, for both
    endpoints (a plain `response_format: {"type": "text"}` asks for nothing); a bad or
    conflicting one is an InvalidRequest (400)."""
    fields = body.model_dump(include=set(STRUCTURED_FIELDS), exclude_none=True)
    convert.structured_to_proto(structured_spec(fields), request.sampling)


def _sampling(body: _Sampling, max_tokens: int | None) -> common_pb2.SamplingParams:
    """Only the fields the client set: an unset one takes the model's generation_config default
    (or the API's own) in validation, as on the gRPC API."""
    values: dict[str, Any] = {
        name: getattr(body, name)
        for name in (
            "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens",
        )
        if getattr(body, name) is not None
    }  # fmt: skip
    if body.logit_bias:
        raise InvalidRequest("logit_bias is not supported")
    for name, low in (("n", 1), ("max_tokens", 1), ("min_tokens", 0), ("seed", 0)):
        value = max_tokens if name == "max_tokens" else getattr(body, name)
        if value is not None and value < low:
            raise InvalidRequest(f"{name} must be >= {low}, got {value}")
    if body.top_k is not None and body.top_k < 0:
        values["top_k"] = 0  # vLLM's -1: no top-k
    msg = common_pb2.SamplingParams(n=body.n, **values)
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    msg.stop.extend(stop)
    if any(t < 0 for t in body.stop_token_ids or []):
        raise InvalidRequest("stop_token_ids must be >= 0")
    msg.stop_token_ids.extend(body.stop_token_ids or [])
    return msg


def _text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(f"message content of type {part.type!r} is not supported")
        parts.append(part.text)
    return "".join(parts)


def _set_stream_interval(body: _Sampling, request: gateway_pb2.GenerateRequest) -> None:
    if body.stream_interval is not None:
        if not 1 <= body.stream_interval <= 4096:  # NOTE: the gateway checks it again
            raise InvalidRequest(
                f"stream_interval must be 1 to 4096 tokens per message, got {body.stream_interval}"
            )
        request.stream_interval = body.stream_interval
    if body.stream_interval_ms is not None:
        request.stream_interval_ms = check_stream_interval_ms(body.stream_interval_ms)


def _refuse(**unsupported: Any) -> None:
    asked = [name for name, value in unsupported.items() if value]
    if asked:
        raise InvalidRequest(f"not supported: {', '.join(asked)}")
