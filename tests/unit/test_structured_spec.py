"""The structured-output spec: its checks, the wire form, and OpenAI's / vLLM's request fields."""

from __future__ import annotations

import json

import pytest

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.structured import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutput
from splitserve.gateway.structured_openai import structured_from_openai
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json_schema=json.dumps(SCHEMA)),
        StructuredOutput(json_object=True),
        StructuredOutput(regex=r"\d+"),
        StructuredOutput(choice=("yes", "no", 'q"uote')),
    ],
)
def test_specs_survive_the_wire(spec):
    params = SamplingParams(temperature=0, max_tokens=9, structured=spec)
    assert convert.sampling_from_proto(convert.sampling_to_proto(params)) == params


def test_no_spec_on_the_wire_is_free_text():
    assert convert.sampling_from_proto(common_pb2.SamplingParams()).structured is None
    assert (
        convert.sampling_from_proto(common_pb2.SamplingParams(json_object=False)).structured is None
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ("a",)}, "exactly one of"),
        ({"json_schema": "{"}, "not valid JSON"),
        ({"json_schema": "[1, 2]"}, "must be a JSON object or boolean"),
        ({"json_schema": '{"type": "strin"}'}, "not a valid JSON Schema at type"),
        ({"json_schema": '{"properties": {"a": {"minLength": -1}}}'}, "properties/a/minLength"),
        ({"json_schema": " " * (MAX_SPEC_CHARS + 1)}, "limit is"),
        ({"regex": "(unclosed"}, "regex does not compile"),
        ({"regex": ""}, "non-empty"),
        ({"choice": ()}, "at least one"),
        ({"choice": ("a", "")}, "non-empty strings"),
        ({"choice": ("x",) * (MAX_CHOICES + 1)}, "limit is"),
        ({"choice": "ab"}, "list of str"),
        ({"json_object": "yes"}, "must be a bool"),
    ],
)
def test_bad_specs_are_invalid_requests_with_bounded_messages(kwargs, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        StructuredOutput(**kwargs)
    assert len(str(info.value)) < 500


def test_bad_spec_on_the_wire_is_refused_by_conversion():
    with pytest.raises(InvalidRequest, match="regex does not compile"):
        convert.sampling_from_proto(common_pb2.SamplingParams(regex="("))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}, "temperature": 0}, None),
        ({"response_format": None, "guided_json": None}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "strict": True, "schema": SCHEMA},
                }
            },
            StructuredOutput(json_schema=json.dumps(SCHEMA)),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(json_schema=json.dumps(SCHEMA))),
        ({"guided_regex": "[ab]+"}, StructuredOutput(regex="[ab]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput(choice=("a", "b"))),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutput(json_schema=json.dumps(SCHEMA)),
        ),
        (
            {"structured_outputs": {"regex": "x+", "disable_any_whitespace": True}},
            StructuredOutput(regex="x+"),
        ),
        ({"structured_outputs": {"choice": ["a"], "json": None}}, StructuredOutput(choice=("a",))),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
    ],
)
def test_openai_and_vllm_fields_map_to_one_spec(body, expected):
    assert structured_from_openai(body) == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "schema is required",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
        ({"response_format": "json"}, "must be an object"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "not several: response_format, guided_regex",
        ),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "not several"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar is not supported"),
        (
            {"structured_outputs": {"grammar": "root ::= 'a'"}},
            "structured_outputs.grammar is not supported",
        ),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "whitespace_pattern is not supported",
        ),
        ({"structured_outputs": {"jsn": {}}}, "not a structured_outputs field"),
        ({"guided_json": ["not", "a", "schema"]}, "guided_json must be a JSON schema object"),
        ({"guided_choice": "a"}, "guided_choice must be a list"),
        ({"guided_regex": 5}, "guided_regex must be a string"),
        ({"guided_json": {"type": 5}}, "not a valid JSON Schema"),
        ({"guided_regex": "(("}, "regex does not compile"),
    ],
)
def test_bad_openai_fields_are_invalid_requests(body, message):
    with pytest.raises(InvalidRequest, match=message):
        structured_from_openai(body)
