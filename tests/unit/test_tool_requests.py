"""A chat request's tools become a plan (tool_choice none/auto/required/named, with the grammar
that forces a call) and a prompt: through the model's template where it renders tools (token
for token what `apply_chat_template(..., tools=...)` gives), else with the gateway's own tool
prompt in the system message, calls and results spelled out in text any template renders."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from splitserve.engine.errors import InvalidRequest
from splitserve.gateway.http_models import (
    ChatCompletionRequest,
    chat_request,
    tool_messages,
    tool_plan,
)
from splitserve.gateway.tool_chat import render_with_tools, tool_prompt
from splitserve.gateway.tool_choice import plan_tools
from splitserve.gateway.tool_parsers import HermesParser, JsonParser, NamedCallParser
from splitserve.testing.tiny_tokenizer import (
    CHATML_TEMPLATE,
    HERMES_TOOLS_TEMPLATE,
    build_tokenizer,
    write_tokenizer_files,
)

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "ping"}},
]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Rain"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for name, template in (("hermes", HERMES_TOOLS_TEMPLATE), ("chatml", CHATML_TEMPLATE)):
        path = tmp_path_factory.mktemp(name)
        write_tokenizer_files(path, build_tokenizer(), model_max_length=2048,
                              chat_template=template)  # fmt: skip
        out[name] = AutoTokenizer.from_pretrained(path)
    return out


def _body(**fields):
    return ChatCompletionRequest(messages=fields.pop("messages", CONVERSATION), **fields)


def test_required_forces_an_array_of_calls_that_match_the_functions():
    plan = plan_tools(TOOLS, "required", None)
    schema = json.loads(plan.structured.json_schema)
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}},
            {"name": "ping", "arguments": {}}]  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "arguments": {}}],
                [{"name": "get_weather", "arguments": {"days": 2}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(plan_tools(TOOLS, "required", False).structured.json_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)


def test_a_named_function_forces_its_parameters_and_none_shows_no_tools():
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert json.loads(named.structured.json_schema) == PARAMS
    assert isinstance(named.parser("hermes"), NamedCallParser)
    ping = plan_tools(TOOLS, {"type": "function", "function": {"name": "ping"}}, None)
    assert json.loads(ping.structured.json_schema) == {"type": "object", "properties": {}}
    none = plan_tools(TOOLS, "none", None)
    assert none.tools == () and none.parser("hermes") is None and none.structured is None
    auto = plan_tools(TOOLS, None, None)
    assert auto.choice == "auto" and auto.structured is None
    assert isinstance(auto.parser("json"), JsonParser)
    assert plan_tools(None, "auto", None) is None


def test_the_grammar_lands_on_the_generate_request_and_excludes_response_format():
    body = _body(tools=TOOLS, tool_choice="required")
    request = chat_request(body, tool_plan(body), [1, 2, 3], max_model_len=100)
    assert list(request.token_ids.ids) == [1, 2, 3]
    assert request.sampling.max_tokens == 97  # the rest of the context
    assert json.loads(request.sampling.json_schema)["type"] == "array"
    with pytest.raises(InvalidRequest, match="can't be combined"):
        tool_plan(_body(tools=TOOLS, response_format={"type": "json_object"}))
    assert tool_plan(_body(tools=TOOLS, tool_choice="none", guided_regex="a+")).choice == "none"


def test_bad_tool_messages_are_refused():
    broken = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    messages = [{"role": "assistant", "tool_calls": [broken]}]
    with pytest.raises(InvalidRequest, match=r"messages\[0\].tool_calls\[0\]"):
        tool_messages(_body(messages=messages))
    with pytest.raises(InvalidRequest, match="unique"):
        plan_tools(TOOLS + TOOLS[:1], "auto", None)


def test_a_template_that_renders_tools_gets_them_as_apply_chat_template_does(tokenizers):
    tok = tokenizers["hermes"]
    messages = tool_messages(_body())
    got = render_with_tools(tok, messages, plan_tools(TOOLS, None, None).tools, "hermes")
    call = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    conversation = [
        CONVERSATION[0], CONVERSATION[1],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Rain"},
    ]  # fmt: skip
    text = tok.apply_chat_template(
        conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert got == tok.encode(text, add_special_tokens=False)
    assert "<tools>" in text and "<tool_response>\nRain\n</tool_response>" in text


@pytest.mark.parametrize("parser", ["hermes", "json"])
def test_a_template_without_tools_gets_the_gateway_tool_prompt(tokenizers, parser):
    tok = tokenizers["chatml"]
    ids = render_with_tools(tok, tool_messages(_body()), TOOLS, parser)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + tool_prompt(TOOLS, parser))
    assert '"name": "get_weather"' in text
    if parser == "hermes":
        written = (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        )
    else:
        written = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nRain\n</tool_response><|im_end|>" in text
    # the model is asked for exactly what the parser reads
    sample = {"hermes": HermesParser, "json": JsonParser}[parser]()
    events = sample.feed(written) + sample.finish()
    assert [type(e).__name__ for e in events][:1] == ["CallStart"]


def _shaper(plan):
    from splitserve.gateway.http_responses import Shaper

    return Shaper("m", chat=True, n=1, top_logprobs=None, token_text=str, tools=plan,
                  parser="hermes")  # fmt: skip


def test_streamed_chunks_carry_openai_tool_call_deltas_and_finish_tool_calls():
    from splitserve.protos.v1 import common_pb2, gateway_pb2

    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces = ["Sure.", "<tool_", 'call>\n{"name": "get_', 'weather", "arguments": {"ci',
              'ty": "Oslo"}}', "\n</tool_call>"]  # fmt: skip
    assert "".join(pieces) == text
    shaper = _shaper(plan_tools(TOOLS, "auto", None))
    chunks = [shaper.chunk(common_pb2.SampleDelta(index=0, text=p)) for p in pieces]
    sent = [c["choices"][0]["delta"] for c in chunks if c is not None]
    assert sent[0] == {"role": "assistant", "content": "Sure."}
    calls = [entry for delta in sent for entry in delta.get("tool_calls", [])]
    first, *rest = calls
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
               for e in rest)  # fmt: skip
    assert "".join(e["function"]["arguments"] for e in calls) == '{"city": "Oslo"}'
    stop = common_pb2.SampleFinish(index=0, finish_reason=common_pb2.FINISH_REASON_STOP)
    (last,) = shaper.final_chunks(gateway_pb2.Finished(samples=[stop]))
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    whole = _shaper(plan_tools(TOOLS, "auto", None))
    whole.add(common_pb2.SampleDelta(index=0, text=text))
    message = whole.response(gateway_pb2.Finished(samples=[stop]))["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Sure."
    (call,) = message["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    plain = _shaper(plan_tools(TOOLS, "auto", None))
    plain.add(common_pb2.SampleDelta(index=0, text="No tools needed."))
    answer = plain.response(gateway_pb2.Finished(samples=[stop]))["choices"][0]
    assert answer["message"] == {"role": "assistant", "content": "No tools needed."}
    assert answer["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call_of_auto():
    from splitserve.protos.v1 import common_pb2, gateway_pb2

    two = "".join(
        f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in ("ping", "ping")
    )
    shaper = _shaper(plan_tools(TOOLS, "auto", False))
    shaper.add(common_pb2.SampleDelta(index=0, text=two))
    stop = common_pb2.SampleFinish(index=0, finish_reason=common_pb2.FINISH_REASON_STOP)
    message = shaper.response(gateway_pb2.Finished(samples=[stop]))["choices"][0]["message"]
    assert len(message["tool_calls"]) == 1
