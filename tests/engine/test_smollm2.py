"""The real default model, SmolLM2-135M-Instruct (a Q4_1 GGUF), against HF transformers loading
the same file by its own GGUF path: the same dequantized weights, and greedy float32 tokens
identical on chat-templated and plain prompts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from splitserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
]
PLAIN = ["Once upon a time", "def fibonacci(n):"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def llm(smollm2):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(smollm2.cache_home))  # converted there already
        # NOTE: a short context keeps the CPU backend's per-step block tables small
        return LLM(smollm2.gguf_dir, dtype="float32", device="cpu", max_model_len=1024)


def test_our_dequantized_weights_are_transformers_own(smollm2, smollm2_hf):
    ours = load_file(str(smollm2.hf_dir / "model.safetensors"))
    theirs = smollm2_hf.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[name]), name


@torch.inference_mode()
def test_greedy_tokens_match_transformers_on_chat_and_plain_prompts(llm, smollm2_hf):
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in CHAT
    ] + PLAIN
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    eos = llm.engine.model_config.eos_token_ids
    for prompt, out in zip(ids, outs, strict=True):
        hf = smollm2_hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == hf, tokenizer.decode(prompt)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].finish_reason == "stop"  # an instruct model ends its turn
