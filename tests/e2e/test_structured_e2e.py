"""Structured outputs through gateway -> prefill -> decode over gRPC, on real processes.

The first token is sampled on the prefill worker and the rest on the decode worker; both must
follow the grammar, so the greedy output equals the offline engine's (which masks every token)
and parses as JSON valid under the schema.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.structured import StructuredOutput
from splitserve.protos.v1 import common_pb2, gateway_pb2
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
PROMPTS = ["The user record reads", "Answer in JSON", "data"]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir)


@pytest.fixture(scope="module")
def stack(model_dir):
    with running_stack(model_dir, prefill=1, decode=1, kv_transport="grpc", http_port=0) as s:
        yield s


def _prompt_ids(llm: LLM, text: str) -> list[int]:
    return list(llm.engine.tokenizer.encode(text, add_special_tokens=False))


def test_json_schema_request_through_prefill_and_decode_gives_valid_json(stack, llm):
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    params = SamplingParams(temperature=0, max_tokens=120, structured=spec)
    free = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    stub = gateway(stack)
    sent_before = sum(stats(w).kv_bytes_sent for w in workers(stack) if w.kind == "prefill")
    for text in PROMPTS:
        prompt = _prompt_ids(llm, text)
        expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        unconstrained = llm.generate([prompt], free, use_tqdm=False)[0].outputs[0].token_ids[0]
        got = collect(stream(stub, prompt, params, timeout_s=60))
        tokens = got.token_ids[0]
        # The first token, sampled on the prefill worker, obeys the grammar: it opens the
        # object, where the model left alone writes something else.
        assert llm.engine.tokenizer.decode(tokens[:1]).startswith("{")
        assert tokens[0] != unconstrained
        assert tokens == expected.token_ids
        jsonschema.validate(json.loads(got.text[0]), SCHEMA)
        assert got.finished.samples[0].finish_reason == 1  # FINISH_REASON_STOP
    sent_after = sum(stats(w).kv_bytes_sent for w in workers(stack) if w.kind == "prefill")
    assert sent_after > sent_before, "the prompts were not prefilled on the prefill worker"
    assert_nothing_leaks(stack)


def test_openai_client_gets_structured_outputs_over_http(stack, llm, model_dir):
    prompt = _prompt_ids(llm, PROMPTS[1])
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    params = SamplingParams(temperature=0, max_tokens=120, structured=spec)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as client:
        got = client.completions.create(
            model=model_dir.name, prompt=prompt, max_tokens=120, temperature=0,
            extra_body={"response_format": response_format},
        )  # fmt: skip
        assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].text), SCHEMA)
        choice = client.completions.create(
            model=model_dir.name, prompt=prompt, max_tokens=16, temperature=1.0, seed=3,
            extra_body={"guided_choice": ["alpha", "beta"]},
        )  # fmt: skip
        assert choice.choices[0].text in ("alpha", "beta")
        with pytest.raises(openai.BadRequestError, match="not several"):
            client.completions.create(
                model=model_dir.name, prompt=prompt, max_tokens=16,
                extra_body={"guided_regex": "a+", "guided_choice": ["a"]},
            )  # fmt: skip
    assert_nothing_leaks(stack)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("json_schema", '{"type": "object", "minProperties": "x"}', "not a valid JSON Schema"),
        ("json_schema", '{"type": ', "not valid JSON"),
        ("regex", "(unclosed", "regex does not compile"),
        # Python's re takes a lookahead, the grammar engine refuses it (on the worker).
        ("regex", "(?=a)b", "Lookahead is not supported"),
    ],
)
def test_bad_specs_are_refused_with_invalid_argument(stack, llm, field, value, message):
    sampling = common_pb2.SamplingParams(max_tokens=8, **{field: value})
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]))
    request.sampling.CopyFrom(sampling)
    with pytest.raises(grpc.RpcError) as info:
        collect(gateway(stack).Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details() and len(info.value.details()) < 600
    assert_nothing_leaks(stack)
