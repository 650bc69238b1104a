"""Tool calling and the vLLM conveniences on a real stack (redis-server, a prefill and a decode
worker, the gateway), driven by the official `openai` client and LangChain: a forced call
(`required`, a named function) comes back as `tool_calls` whose arguments validate against the
function's schema, streamed or not; `auto` answers with text or a call; a tool's result goes
back through the chat template; /tokenize, /detokenize, /version, /metrics and `echo` work.

The tiny model's tokenizer carries a Hermes-style template that renders tools (as Qwen's does).
Its random weights write no sensible call of their own; a grammar forces the forced ones."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from splitserve.testing.tiny_model import make_tiny_model
from splitserve.testing.tiny_tokenizer import HERMES_TOOLS_TEMPLATE
from tests.e2e.harness import assert_nothing_leaks, running_stack

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
COMMON = {"max_tokens": 120, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    return make_tiny_model(root / "tiny-hermes", "llama", chat_template=HERMES_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def stack(model_dir):
    with running_stack(model_dir, prefill=1, decode=1, http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def root_url(stack):
    return stack.http_url.removesuffix("/v1")


def _valid(name, arguments):
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _assembled(chunks):
    """The calls a client assembles from streamed deltas: {index: [id, name, arguments]}."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, ["", "", ""])
                if delta.id:
                    assert not entry[0], "a call's id comes once, first"
                    entry[0], entry[1] = delta.id, delta.function.name
                    assert delta.type == "function"
                entry[2] += delta.function.arguments or ""
    return calls


def test_required_returns_a_call_whose_arguments_validate(client, model_dir, stack):
    reply = client.chat.completions.create(
        model=model_dir.name, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, **COMMON,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS
    _valid(call.function.name, call.function.arguments)
    chunks = list(
        client.chat.completions.create(
            model=model_dir.name, messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, stream=True, **COMMON,
        )
    )  # fmt: skip
    streamed = _assembled(chunks)
    assert list(streamed) == [0]
    assert streamed[0][1:] == [call.function.name, call.function.arguments]  # greedy: the same
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert_nothing_leaks(stack)


def test_a_named_function_is_called_with_valid_arguments_streamed_and_not(client, model_dir):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model=model_dir.name, messages=ASK, tools=TOOLS, tool_choice=named, **COMMON
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and reply.choices[0].finish_reason == "tool_calls"
    _valid("get_time", call.function.arguments)
    chunks = list(
        client.chat.completions.create(
            model=model_dir.name, messages=ASK, tools=TOOLS, tool_choice=named, stream=True,
            **COMMON,
        )
    )  # fmt: skip
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or ()) if c.choices]
    assert deltas[0].id and deltas[0].function.name == "get_time"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert _assembled(chunks)[0][2] == call.function.arguments


def test_auto_answers_with_text_or_a_call(client, model_dir):
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=model_dir.name, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0,
            stream=stream,
        )  # fmt: skip
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = _assembled(chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            message = reply.choices[0].message
            text, finish = message.content or "", reply.choices[0].finish_reason
            calls = {i: [c.id, c.function.name, c.function.arguments]
                     for i, c in enumerate(message.tool_calls or ())}  # fmt: skip
        assert finish in ("stop", "length", "tool_calls")
        assert bool(calls) == (finish == "tool_calls") or finish == "length"  # cut mid-call
        assert text or calls


def test_a_tool_result_goes_back_through_the_template_and_continues(client, model_dir, root_url):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]  # fmt: skip
    reply = client.chat.completions.create(
        model=model_dir.name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content is not None
    counted = httpx.post(f"{root_url}/tokenize", json={"messages": messages}, timeout=30).json()
    assert reply.usage.prompt_tokens == counted["count"]
    rendered = httpx.post(
        f"{root_url}/detokenize", json={"tokens": counted["tokens"]}, timeout=30
    ).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in (
        rendered
    )
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_tokenize_renders_the_tools_as_a_chat_does(client, model_dir, root_url):
    reply = client.chat.completions.create(
        model=model_dir.name, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0
    )
    body = {"messages": ASK, "tools": TOOLS, "return_token_strs": True}
    counted = httpx.post(f"{root_url}/tokenize", json=body, timeout=30).json()
    assert counted["count"] == reply.usage.prompt_tokens == len(counted["tokens"])
    assert counted["max_model_len"] > counted["count"] and len(counted["token_strs"]) == len(
        counted["tokens"]
    )
    text = httpx.post(f"{root_url}/detokenize", json={"tokens": counted["tokens"]}).json()
    assert '"name": "get_weather"' in text["prompt"] and "<tools>" in text["prompt"]
    plain = httpx.post(f"{root_url}/tokenize", json={"prompt": "Hello world"}).json()
    back = httpx.post(f"{root_url}/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    out_of_range = httpx.post(f"{root_url}/detokenize", json={"tokens": [10**9]})
    assert out_of_range.status_code == 400 and "vocabulary" in out_of_range.text
    bad_role = httpx.post(f"{root_url}/tokenize", json={"messages": [{"role": "robot"}]})
    assert bad_role.status_code == 400 and "role" in bad_role.json()["error"]["message"]
    neither = httpx.post(f"{root_url}/tokenize", json={})
    assert neither.status_code == 400 and "either" in neither.json()["error"]["message"]


def test_echo_puts_the_prompt_before_the_completion(client, model_dir):
    plain = client.completions.create(
        model=model_dir.name, prompt="The quick brown", max_tokens=5, temperature=0
    )
    echoed = client.completions.create(
        model=model_dir.name, prompt="The quick brown", max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The quick brown" + plain.choices[0].text
    chunks = list(
        client.completions.create(
            model=model_dir.name, prompt="The quick brown", max_tokens=5, temperature=0,
            echo=True, stream=True,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        client.completions.create(
            model=model_dir.name, prompt="x", max_tokens=2, echo=True, logprobs=1
        )


def test_version_and_metrics_on_the_http_port(client, model_dir, root_url):
    client.completions.create(model=model_dir.name, prompt="Hi", max_tokens=2)
    version = httpx.get(f"{root_url}/version", timeout=30).json()["version"]
    assert version and version[0].isdigit()
    metrics = httpx.get(f"{root_url}/metrics", timeout=30)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "splitserve" in metrics.text and "time_to_first_token" in metrics.text


def test_unsupported_tool_requests_are_400_naming_the_problem(root_url, model_dir):
    url = f"{root_url}/v1/chat/completions"
    cases = [
        ({"tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "can't be combined"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the tools"),
        ({"tool_choice": "required"}, "needs `tools`"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, "parameters"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ]  # fmt: skip
    for extra, words in cases:
        got = httpx.post(url, json={"model": model_dir.name, "messages": ASK, **extra}, timeout=30)
        assert got.status_code == 400, (extra, got.text)
        assert words in got.json()["error"]["message"], got.text


def test_langchain_bind_tools_and_invoke(stack, model_dir):
    import langchain_openai  # NOTE: declared in the test extra: never skipped

    llm = langchain_openai.ChatOpenAI(
        base_url=stack.http_url, api_key="unused", model=model_dir.name, temperature=0,
        max_tokens=120, max_retries=0,
    )  # fmt: skip
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_PARAMS)


def test_splitserve_generate_prints_the_finish_reason_as_a_word(stack):
    run = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "generate", "Hello", "--address", stack.address,
         "--max-tokens", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert re.search(r"; finish (stop|length)\]", run.stderr), run.stderr
