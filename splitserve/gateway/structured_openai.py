"""OpenAI's and vLLM's structured-output request fields, as one `StructuredOutput`.

    response_format: {"type": "json_schema", "json_schema": {"schema": {...}, "strict": ...}}
    response_format: {"type": "json_object"}          response_format: {"type": "text"}
    guided_json / guided_regex / guided_choice        (vLLM's older names)
    structured_outputs: {"json" | "regex" | "choice" | "json_object": ...}   (vLLM's newer one)

A request may ask for one constraint; two (say `response_format` and `guided_regex`) is a 400.
Grammars vLLM also takes but this server can't honour (`guided_grammar`, `structural_tag`, a
custom `whitespace_pattern`) are refused by name rather than ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.structured import StructuredOutput

# structured_outputs options that only restate what every structured output here does
# (compact JSON, no extra properties, no fallback engine).
_NO_OP_OPTIONS = frozenset(
    {"disable_any_whitespace", "disable_additional_properties", "disable_fallback"}
)
_UNSUPPORTED = ("grammar", "structural_tag", "whitespace_pattern")


def _schema_text(name: str, schema: object) -> str:
    """A schema given as an object (or JSON text, as some clients send it) as JSON text."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema)
    raise InvalidRequest(f"{name} must be a JSON schema object, got {type(schema).__name__}")


def _choice(name: str, value: object) -> StructuredOutput:
    if not isinstance(value, (list, tuple)):
        raise InvalidRequest(f"{name} must be a list of strings, got {type(value).__name__}")
    return StructuredOutput(choice=tuple(value))


def _regex(name: str, value: object) -> StructuredOutput:
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}")
    return StructuredOutput(regex=value)


def _response_format(value: object) -> StructuredOutput | None:
    if not isinstance(value, Mapping):
        raise InvalidRequest("response_format must be an object with a `type`")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, Mapping) or inner.get("schema") is None:
            raise InvalidRequest("response_format.json_schema.schema is required")
        # NOTE: `strict` true or false, the output follows the schema (as vLLM does).
        text = _schema_text("response_format.json_schema.schema", inner["schema"])
        return StructuredOutput(json_schema=text)
    raise InvalidRequest(
        f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}"
    )


def _structured_outputs(value: object) -> list[tuple[str, StructuredOutput]]:
    if not isinstance(value, Mapping):
        raise InvalidRequest("structured_outputs must be an object")
    found: list[tuple[str, StructuredOutput]] = []
    for key, item in value.items():
        name = f"structured_outputs.{key}"
        if item is None or item is False or key in _NO_OP_OPTIONS:
            continue
        if key == "json":
            found.append((name, StructuredOutput(json_schema=_schema_text(name, item))))
        elif key == "regex":
            found.append((name, _regex(name, item)))
        elif key == "choice":
            found.append((name, _choice(name, item)))
        elif key == "json_object":
            found.append((name, StructuredOutput(json_object=True)))
        elif key in _UNSUPPORTED:
            raise InvalidRequest(f"{name} is not supported (json, json_object, regex, choice are)")
        else:
            raise InvalidRequest(f"{name} is not a structured_outputs field")
    return found


def structured_from_openai(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The structured output an OpenAI-style request body asks for, or None for free text.

    `body` is the request's JSON object (a pydantic model's `model_dump()` does: keys whose value
    is None count as absent). Reads `response_format`, `guided_json`, `guided_regex`,
    `guided_choice`, `guided_grammar` and `structured_outputs`, and ignores every other key.
    Raises InvalidRequest (HTTP 400) for a malformed or unsupported field, for more than one
    constraint, and for a spec that is not valid (a schema that is not a JSON Schema, a regex
    that does not compile, an empty choice).

    To put the result on a `GenerateRequest`, use
    `splitserve.protos.convert.structured_to_proto(spec, request.sampling)`.
    """
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("guided_json") is not None:
        text = _schema_text("guided_json", body["guided_json"])
        found.append(("guided_json", StructuredOutput(json_schema=text)))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", _regex("guided_regex", body["guided_regex"])))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", _choice("guided_choice", body["guided_choice"])))
    if body.get("guided_grammar") is not None:
        raise InvalidRequest("guided_grammar is not supported (json, regex and choice are)")
    if body.get("structured_outputs") is not None:
        found.extend(_structured_outputs(body["structured_outputs"]))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequest(f"ask for one structured output, not several: {names}")
    return found[0][1] if found else None
