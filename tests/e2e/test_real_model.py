"""The real default model (SmolLM2-135M-Instruct, from its GGUF) through the disaggregated path:
gateway -> prefill worker -> KV push -> decode worker, as real processes. Its greedy answer is
HF transformers' token for token; a JSON-schema request gives JSON that validates (forced
tool calls on this model: test_real_model_tools.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from splitserve.client import collect, connect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.tokenizer import load_tokenizer
from tests.e2e.harness import assert_nothing_leaks, running_stack

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stack(smollm2):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(smollm2.cache_home))  # the GGUF is converted there
        with running_stack(
            smollm2.gguf_dir,  # a directory holding a GGUF, as `splitserve up --model DIR`
            prefill=1,
            decode=1,
            kv_transport="grpc",
            worker_args=("--max-model-len", "2048"),
            http_port=0,
            env=smollm2.env(),
        ) as s:
            yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=120)


@torch.inference_mode()
def test_the_answer_through_prefill_and_decode_is_hfs(stack, smollm2, smollm2_hf):
    tokenizer = load_tokenizer(smollm2.hf_dir)
    chat = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = smollm2_hf.generate(
        torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )[0, len(ids) :].tolist()
    channel, stub = connect(stack.address)
    with channel:
        done = collect(stream(stub, QUESTION, SamplingParams(temperature=0, max_tokens=32),
                              timeout_s=120, chat=True))  # fmt: skip
    assert done.token_ids[0] == expected
    assert "Paris" in done.text[0]
    assert done.finished is not None and done.finished.usage.prompt_tokens == len(ids)
    assert_nothing_leaks(stack)


def test_a_json_schema_request_gives_json_that_validates(stack, client):
    reply = client.chat.completions.create(
        model=stack.model.rstrip("/").rsplit("/", 1)[-1],
        messages=[{"role": "user", "content": "Make up a person: a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        max_tokens=48,
        temperature=0,
    )
    content = reply.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), PERSON)
    assert_nothing_leaks(stack)
