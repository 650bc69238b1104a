"""A checkpoint is read as HF reads it: BOS added as the tokenizer says, EOS ids from both
config.json and generation_config.json; streamed text equals HF's decode. HF transformers on
the same files is the oracle."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.tokenizer import IncrementalDetokenizer
from splitserve.testing.tiny_model import make_tiny_model
from tests.engine.hf_oracle import hf_greedy, hf_model

PROMPTS = ["The quick brown fox", "Numbers matter: 42", "日本語のテキスト"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bos") / "llama", "llama", add_bos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_text_prompts_are_tokenized_as_hf_does_bos_included(tiny_models, bos_model, arch):
    model_dir = bos_model if arch == "llama" else tiny_models[arch]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        hf_ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == hf_ids
        assert (hf_ids[0] == tokenizer.bos_token_id) == (arch == "llama")
        assert out.outputs[0].token_ids == _hf_greedy_with_bos(model_dir, hf_ids)


@torch.inference_mode()
def _hf_greedy_with_bos(model_dir, prompt: list[int]) -> list[int]:
    """HF's greedy tokens, EOS ignored. NOTE: an explicit attention mask: the tiny tokenizer's
    BOS id is 0, which `hf_greedy`'s pad id would mask out."""
    ids = torch.tensor([prompt])
    out = hf_model(model_dir).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
        min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=2,
    )  # fmt: skip
    return list(out[0, len(prompt) :].tolist())


@torch.inference_mode()
def test_generation_config_eos_ids_stop_generation_as_in_hf(tmp_path, tiny_models):
    base = tiny_models["llama"]
    prompt = AutoTokenizer.from_pretrained(base)("The quick brown fox").input_ids
    free = hf_greedy(base, tuple(prompt), MAX_NEW)
    # NOTE: a token the model emits mid-way becomes an end-of-turn id, in generation_config only
    stop_id = next(t for t in free[4:] if t not in free[:4])
    model_dir = make_tiny_model(
        tmp_path / "eot", "llama", generation_config={"eos_token_id": [1, stop_id]}
    )
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == 1
    hf = hf_model(model_dir)
    ids = torch.tensor([prompt])
    hf_out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
    )
    hf_tokens = hf_out[0, len(prompt) :].tolist()
    assert hf_tokens[-1] == stop_id and len(hf_tokens) < MAX_NEW  # HF stopped on it
    llm = LLM(model_dir)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    sample = out[0].outputs[0]
    assert sample.token_ids == hf_tokens
    assert sample.finish_reason == "stop"


def test_streamed_text_equals_hfs_decode(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    rng = random.Random(5)
    text = "café 🙂 日本語 → x ± y; the quick brown fox 42 "
    ids = tokenizer(text * 3).input_ids
    for trial in range(20):
        prompt = tokenizer(rng.choice(["", "Hello", "Hello there, café", "日本"])).input_ids
        # NOTE: random ids may hold bytes no character ever completes (U+FFFD in HF's decode
        # too); the clean text never shows one, however it is cut.
        generated = ids if trial % 2 else [rng.randrange(5, 500) for _ in range(40)] + ids
        detok = IncrementalDetokenizer(tokenizer, prompt)
        cut = 0
        while cut < len(generated):
            step = rng.randrange(1, 4)
            detok.add(generated[cut : cut + step], final=cut + step >= len(generated))
            cut += step
            assert generated is not ids or "\ufffd" not in detok.text
        assert detok.text == tokenizer.decode(generated, skip_special_tokens=True)
