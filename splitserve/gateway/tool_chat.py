"""A conversation with tools, rendered by the model's chat template into prompt token ids.

Where the template renders tools itself (it mentions `tools`: Qwen, Hermes, Llama 3.1+), it
gets them as `apply_chat_template(..., tools=...)` does, with assistant `tool_calls` (their
arguments as objects, as HF templates expect) and `tool` messages as they are. Where it does
not (SmolLM2's, plain ChatML), the gateway writes the tools into the system message itself,
asking for the form the tool-call parser reads, writes earlier calls into the assistant's text
in that form, and turns tool results into user turns (`<tool_response>`), which any template
renders.

The prompt is tokenized without adding special tokens again (the template writes BOS where the
model has one), as the gateway's own chat path does (validation.render_chat).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from splitserve.engine.errors import InvalidRequest
from splitserve.gateway.tool_parsers import renders_tools

_CALL_FORMS = {
    "hermes": (
        "For each function call, reply with a JSON object with the function's name and "
        "arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    ),
    "json": (
        "To call a function, reply with only a JSON object of the form "
        '{"name": <function-name>, "parameters": <args-json-object>}, and nothing else.'
    ),
}


def template_text(tokenizer: Any) -> str | None:
    """The tokenizer's chat template as text (a dict of named templates: all of them)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None


def tool_prompt(tools: Sequence[dict[str, Any]], parser: str) -> str:
    """The system text that shows the model the tools, for a template that renders none."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The "
        f"function signatures are within <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        f"{_CALL_FORMS[parser]}"
    )


def render_with_tools(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    parser: str,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of `messages` (OpenAI's shapes: content as text, `tool_calls`, `tool`
    messages), with `tools` shown to the model, and the assistant's generation prompt."""
    template = template_text(tokenizer)
    if not template:
        raise InvalidRequest(
            "this model has no chat template (none in its tokenizer_config.json or "
            "chat_template.jinja); send a plain prompt instead"
        )
    if renders_tools(template):
        conversation = [_for_template(m) for m in messages]
        shown: list[dict[str, Any]] | None = list(tools) or None
    else:
        conversation = _spelled_out(messages, tools, parser)
        shown = None
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=shown, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except (TemplateError, ValueError, TypeError) as exc:  # a template that refuses them
        raise InvalidRequest(f"the chat template refused these messages: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _spelled_out(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], parser: str
) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: tools in the system message, calls
    in the assistant's text, results as user turns (consecutive ones merged)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                _call_text(call["name"], call["arguments"], parser)
                for call in message["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and "<tool_response>" in out[-1]["content"]:
                out[-1]["content"] += "\n" + content
                continue
        out.append({"role": role, "content": content})
    if tools:
        prompt = tool_prompt(tools, parser)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_text(name: str, arguments: dict[str, Any], parser: str) -> str:
    if parser == "json":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"
