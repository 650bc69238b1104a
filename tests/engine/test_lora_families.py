"""LoRA on the newer families: adapters on the attention projections of a Mixture-of-Experts
model and on every projection of Gemma 3 (GeGLU MLP) give HF + peft's greedy tokens; an adapter
on a Mixture-of-Experts layer's MLP is refused with a clear error."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.errors import InvalidRequest
from splitserve.engine.lora import LoRARequest
from splitserve.testing.tiny_lora import make_tiny_lora
from tests.engine.hf_oracle import random_prompts
from tests.engine.lora_oracle import peft_greedy

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(
    ("family", "targets"),
    [("qwen3_moe", ATTENTION), ("gemma3", (*ATTENTION, "gate_proj", "up_proj", "down_proj"))],
)
def test_adapter_matches_peft(tiny_families, tmp_path, family, targets):
    model_dir = tiny_families[family]
    adapter = make_tiny_lora(model_dir, tmp_path / "a", seed=3, target_modules=targets)
    llm = LLM(model_dir, lora_modules=(("a", str(adapter)),))
    prompts = random_prompts([5, 23, 40], llm.engine.model_config.vocab_size, seed=5)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a"))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == peft_greedy(model_dir, adapter, prompt, MAX_NEW)


def test_adapter_on_experts_is_refused(tiny_families, tmp_path):
    model_dir = tiny_families["qwen3_moe"]  # layer 1 is dense; layers 0 and 2 are sparse
    adapter = make_tiny_lora(model_dir, tmp_path / "m", seed=4, target_modules=("q_proj",))
    # What an adapter trained on a dense model of the same shape holds for the MLP of layer 0.
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.zeros(8, 64)
    tensors[f"{prefix}.lora_B.weight"] = torch.zeros(96, 8)
    save_file(tensors, weights)
    with pytest.raises(InvalidRequest, match="Mixture-of-Experts block"):
        LLM(model_dir, lora_modules=(("m", str(adapter)),))
