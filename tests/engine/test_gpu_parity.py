"""On a GPU in bf16: the engine (Triton kernels, CUDA graphs) against HF transformers bf16 on the
same weights. Logits within bf16 tolerance; greedy tokens over 32 steps agree for most prompts.
Skipped without CUDA (CI has none); run on the device with `pytest tests/engine -k gpu -s`."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tiny_model import make_tiny_model
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Real head and layer geometry (Qwen3-0.6B-like heads), few layers, small vocab.
SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", config_overrides=SHAPE
    )


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def test_gpu_bf16_logits_within_tolerance_and_greedy_agreement_rate(model_dir, hf):
    llm = LLM(model_dir, dtype="bfloat16", device="cuda")
    assert llm.engine.config.attention_backend == "triton"
    assert llm.engine.runner.graphs is not None
    prompts = random_prompts(
        [5, 17, 64, 100, 250, 400, 33, 128, 7, 300, 90, 512, 48, 200, 16, 77],
        llm.engine.model_config.vocab_size,
        seed=3,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    agree = 0
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            ids = torch.tensor([prompt + tokens], device="cuda")
            ref = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        ours = torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)])
        theirs = ref[torch.arange(len(tokens)), torch.tensor(tokens, device="cuda")].cpu()
        worst = max(worst, (ours - theirs).abs().max().item())
        hf_tokens = hf.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )
        agree += hf_tokens[0, len(prompt) :].tolist() == tokens
    print(
        f"\nGPU bf16: greedy 32-token agreement {agree}/{len(prompts)}, "
        f"max |logprob diff| of chosen tokens {worst:.4f}"
    )
    assert worst < 0.25, "logprobs must agree within bf16 tolerance"
    assert agree >= len(prompts) // 2
