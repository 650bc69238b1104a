"""The gateway's prompt handling: chat messages render exactly as the tokenizer's own
`apply_chat_template` does (token ids compared), a model without a template is refused, text
gets the tokenizer's special tokens, and unset sampling fields take generation_config.json's
defaults (on both APIs: the HTTP API hands the same GenerateRequest to the same validation)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.platform import resolve_dtype
from splitserve.gateway.validation import validate_request
from splitserve.protos.v1 import common_pb2, gateway_pb2
from splitserve.testing.tiny_model import make_tiny_model

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! Can you help me with my code?"},
    {"role": "assistant", "content": "Of course."},
    {"role": "user", "content": "What is 2 + 2? Answer in Japanese: 日本語"},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {
        "chatml": make_tiny_model(root / "chatml", "qwen3"),
        "bare": make_tiny_model(root / "bare", "llama", chat_template=None),
        "bos": make_tiny_model(
            root / "bos",
            "llama",
            add_bos=True,
            generation_config={"eos_token_id": [1, 4], "temperature": 0.6, "top_k": 20},
        ),
    }


def _validate(model_dir, **request):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    job = validate_request(gateway_pb2.GenerateRequest(**request), tokenizer, config, 2048)
    return job, tokenizer


def _messages(conversation):
    return gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in conversation])


def test_chat_messages_render_exactly_as_apply_chat_template(models):
    job, tokenizer = _validate(models["chatml"], messages=_messages(CONVERSATION))
    rendered = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    want = rendered if isinstance(rendered, list) else rendered["input_ids"]
    assert job.prompt_token_ids == list(want)
    assert job.params.max_tokens == 2048 - len(want)  # unset: up to the context's end


def test_a_model_without_a_chat_template_is_refused_clearly(models):
    with pytest.raises(InvalidRequest, match="no chat template"):
        _validate(models["bare"], messages=_messages(CONVERSATION))
    with pytest.raises(InvalidRequest, match="messages is empty"):
        _validate(models["chatml"], messages=gateway_pb2.ChatMessages())


def test_text_gets_the_special_tokens_the_tokenizer_adds(models):
    job, tokenizer = _validate(models["bos"], text="Hello there")
    assert job.prompt_token_ids == tokenizer("Hello there").input_ids
    assert job.prompt_token_ids[0] == tokenizer.bos_token_id
    plain, _ = _validate(models["bare"], text="Hello there")
    assert plain.prompt_token_ids[0] != tokenizer.bos_token_id


def test_generation_config_supplies_eos_ids_and_defaults_for_unset_fields(models):
    config = ModelConfig.from_pretrained(models["bos"])
    assert config.eos_token_ids == (1, 4)
    job, _ = _validate(models["bos"], text="Hi")
    assert (job.params.temperature, job.params.top_k) == (0.6, 20)
    sampling = common_pb2.SamplingParams(temperature=0.0, top_k=0)
    job, _ = _validate(models["bos"], text="Hi", sampling=sampling)
    assert (job.params.temperature, job.params.top_k) == (0.0, 0)  # set fields win


def test_dtype_auto_follows_the_checkpoints_torch_dtype():
    assert resolve_dtype("auto", "cpu", "bfloat16") is torch.bfloat16
    assert resolve_dtype("auto", "cpu", "float16") is torch.float16
    assert resolve_dtype("auto", "cpu", "float32") is torch.float32
    assert resolve_dtype("auto", "cuda", "float32") is torch.bfloat16
    assert resolve_dtype("auto", "cpu", None) is torch.float32
    assert resolve_dtype("float32", "cpu", "bfloat16") is torch.float32
