"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, as a `ToolPlan`.

    tool_choice  none       the model is not shown the tools; its text is the answer
                 auto       shown the tools; its text is parsed (`--tool-call-parser`) into
                            `tool_calls` where it wrote calls, else it is the answer (the
                            default when tools are given)
                 required   a grammar makes it write one call or more (exactly one with
                            parallel_tool_calls false): `[{"name", "arguments"}, …]`
                 {"type": "function", "function": {"name": N}}
                            a grammar makes it write the arguments of function N

The grammars go through structured outputs (a JSON schema for xgrammar), built from each
function's `parameters` schema, so forced arguments always parse and validate against it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.structured import StructuredOutput, parse_json_schema
from splitserve.gateway.tool_parsers import (
    ForcedCallsParser,
    NamedCallParser,
    ToolCallParser,
    make_parser,
)

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields ask for.

    `tools` are the function tools shown to the chat template (empty for `none`); `choice` is
    none, auto, required or named (`name`: the function); `structured` the grammar that forces
    the call (required, named); `parallel` whether more than one call may be returned."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True
    structured: StructuredOutput | None = None

    def parser(self, kind: str) -> ToolCallParser | None:
        """A fresh parser for one sample's text (None: the text is the answer as it is);
        `kind` is the gateway's `--tool-call-parser` (resolved) for `auto`."""
        if self.choice == "none":
            return None
        if self.choice == "required":
            return ForcedCallsParser()
        if self.choice == "named":
            assert self.name is not None
            return NamedCallParser(self.name)
        return make_parser(kind)


def plan_tools(
    tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolPlan | None:
    """The plan for these request fields (None when no tools are given and none are asked for);
    InvalidRequest naming the field that is malformed or asks for what can't be done."""
    functions = tuple(_function(i, tool) for i, tool in enumerate(tools or ()))
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools: function names must be unique, got {names}")
    choice, name = _choice(tool_choice)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if not functions:
        if choice in ("required", "named"):
            raise InvalidRequest(f"tool_choice {tool_choice!r:.80} needs `tools`")
        return None
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan((), "none", parallel=parallel)
    if choice == "named":
        by_name = {f["function"]["name"]: f for f in functions}
        if name not in by_name:
            raise InvalidRequest(
                f"tool_choice names function {name!r:.80}, which is not among the tools "
                f"({', '.join(by_name)})"
            )
        schema = _parameters(by_name[name])
        return ToolPlan(functions, "named", name, parallel, _structured(schema))
    if choice == "required":
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": _parameters(f)},
                "required": ["name", "arguments"],
            }
            for n, f in zip(names, functions, strict=True)
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(functions, "required", None, parallel, _structured(schema))
    return ToolPlan(functions, "auto", None, parallel)


def _function(i: int, tool: Any) -> dict[str, Any]:
    """Tool `i`, checked: a function with a valid name and a JSON Schema for its parameters."""
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise InvalidRequest(f"{where}: only tools of type 'function' are supported")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequest(f"{where}.function must be an object with a `name`")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(
            f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r:.80}"
        )
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON Schema object")
        try:
            parse_json_schema(json.dumps(parameters))
        except InvalidRequest as exc:
            raise InvalidRequest(f"{where}.function.parameters: {exc}") from None
    return {"type": "function", "function": dict(function)}


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    return dict(function["function"].get("parameters") or _NO_PARAMETERS)


def _choice(value: Any) -> tuple[str | None, str | None]:
    """(none | auto | required | named | None when unset, the named function)."""
    if value is None:
        return None, None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequest(
                f"tool_choice must be none, auto, required or a function, got {value!r:.80}"
            )
        return value, None
    function = value.get("function") if isinstance(value, Mapping) else None
    if (
        not isinstance(value, Mapping)
        or value.get("type") != "function"
        or not isinstance(function, Mapping)
        or not isinstance(function.get("name"), str)
    ):
        raise InvalidRequest(
            'tool_choice as an object must be {"type": "function", "function": {"name": ...}}'
        )
    return "named", function["name"]


def _structured(schema: dict[str, Any]) -> StructuredOutput:
    try:
        return StructuredOutput(json_schema=json.dumps(schema))
    except InvalidRequest as exc:
        raise InvalidRequest(f"tools: the call's grammar can't be built: {exc}") from None
