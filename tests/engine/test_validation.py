"""Bad input fails up front with a clear ValueError, before any forward pass runs."""

from __future__ import annotations

import json
import shutil

import pytest

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], max_model_len=256)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", None, "prompt is empty"),
        ([], None, "prompt is empty"),
        (list(range(3, 300)), None, "leaves no room"),
        ([5, 10**6], None, "outside the vocabulary"),
        ([5, -1], None, "outside the vocabulary"),
        ([5, "a"], None, "list of ints"),
        ([5, 6], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ([5, 6], SamplingParams(n=257), "max_num_seqs"),  # never scheduled: refused at once
    ],
)
def test_bad_request_raises_clear_value_error(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 100}, "logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_out_of_range_sampling_values_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], []], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_usage().num_used_blocks == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 3


def test_unknown_llm_option_is_rejected(tiny_models):
    with pytest.raises(ValueError, match="unknown LLM option"):
        LLM(tiny_models["llama"], blocksize=16)


def test_request_larger_than_kv_pool_is_rejected(tiny_models):
    engine = LLMEngine(tiny_models["llama"], EngineConfig(num_kv_blocks=4))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(list(range(3, 100)), SamplingParams(max_tokens=10))


def _copy_model(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_models, tmp_path):
    model = _copy_model(tiny_models["llama"], tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(model)


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("config.json", "no config.json"),
        ("tokenizer.json", "no tokenizer.json"),
        ("model.safetensors", "has no weights"),
    ],
)
def test_missing_file_is_named(tiny_models, tmp_path, missing, message):
    model = _copy_model(tiny_models["llama"], tmp_path)
    (model / missing).unlink()
    with pytest.raises(ValueError, match=message):
        LLM(model)


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nowhere")


def test_weights_that_do_not_fit_the_config_are_named(tiny_models, tmp_path):
    model = _copy_model(tiny_models["llama"], tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp.*shape"):
        LLM(model)
