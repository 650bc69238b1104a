"""What a request's output must look like: a JSON schema, any JSON object, a regex, or a choice.

`StructuredOutput` is the spec carried by `SamplingParams.structured` (and, on the wire, the
`structured` oneof of `SamplingParams`). Construction checks what can be checked without a
tokenizer or torch — the schema parses and is a valid JSON Schema, the regex compiles, the
choices are non-empty — so the gateway refuses a bad spec before any worker sees it. The
grammar itself is compiled on the workers (`engine.grammar`), from the model's tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from splitserve.engine.errors import InvalidRequest, clip

MAX_SPEC_CHARS = 64 * 1024
"""Upper bound on a schema's, regex's or all choices' total length: a spec is compiled on the
engine thread, so its size bounds the time one request can hold every other one up."""

MAX_CHOICES = 1024
"""Upper bound on the number of alternatives of a `choice` spec."""

_MAX_DETAIL = 300  # characters of a parser's message echoed back to the client


def _detail(error: object) -> str:
    """A parser's message, one line and bounded, for an InvalidRequest."""
    return clip(" ".join(str(error).split()), _MAX_DETAIL)


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(
            f"structured output {name} is {len(text)} characters; the limit is {MAX_SPEC_CHARS}"
        )


def parse_json_schema(text: str) -> dict[str, Any] | bool:
    """The schema in `text`, after checking it is JSON and a valid JSON Schema (its own
    `$schema` draft, or 2020-12); raise InvalidRequest naming the problem otherwise."""
    from jsonschema import exceptions, validators  # imported on first use: it is not small

    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"json_schema is not valid JSON: {_detail(e)}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(
            f"json_schema must be a JSON object or boolean, got {type(schema).__name__}"
        )
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(
            schema
        )
    except exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise InvalidRequest(
            f"json_schema is not a valid JSON Schema at {where}: {_detail(e.message)}"
        ) from None
    return schema


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on generated text; exactly one field is set.

    Attributes:
        json_schema: a JSON Schema (as JSON text) the output must validate against. Output is
            compact JSON (no optional whitespace) and objects hold no properties the schema
            does not name, as OpenAI's `strict` mode does.
        json_object: the output is a JSON object (any keys).
        regex: the whole output matches this regular expression.
        choice: the output is exactly one of these strings.

    Equal specs are equal objects (and hash alike), so a spec is the key of the compiled
    grammar cache.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise InvalidRequest(f"json_object must be a bool, got {self.json_object!r}")
        kinds = [
            name
            for name, set_ in (
                ("json_schema", self.json_schema is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
            )
            if set_
        ]
        if len(kinds) != 1:
            raise InvalidRequest(
                "structured output needs exactly one of json_schema, json_object, regex, "
                f"choice; got {', '.join(kinds) or 'none'}"
            )
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise InvalidRequest("json_schema must be JSON text (a str)")
            _check_size("json_schema", self.json_schema)
            parse_json_schema(self.json_schema)
        if self.regex is not None:
            self._check_regex(self.regex)
        if self.choice is not None:
            object.__setattr__(self, "choice", self._check_choice(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: "json_schema", "json_object", "regex" or "choice"."""
        if self.json_schema is not None:
            return "json_schema"
        if self.json_object:
            return "json_object"
        return "regex" if self.regex is not None else "choice"

    @staticmethod
    def _check_regex(regex: object) -> None:
        if not isinstance(regex, str) or not regex:
            raise InvalidRequest(f"regex must be a non-empty str, got {type(regex).__name__}")
        _check_size("regex", regex)
        try:
            re.compile(regex)
        except re.error as e:
            raise InvalidRequest(f"regex does not compile: {_detail(e)}") from None

    @staticmethod
    def _check_choice(choice: object) -> tuple[str, ...]:
        if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)):
            raise InvalidRequest(f"choice must be a list of str, got {type(choice).__name__}")
        items = tuple(choice)
        if not items:
            raise InvalidRequest("choice must list at least one string")
        if len(items) > MAX_CHOICES:
            raise InvalidRequest(f"choice lists {len(items)} strings; the limit is {MAX_CHOICES}")
        for item in items:
            if not isinstance(item, str) or not item:
                raise InvalidRequest(f"choice must hold non-empty strings, got {item!r:.64}")
        _check_size("choice", "".join(items))
        return items
