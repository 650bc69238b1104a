"""An FP8 KV cache on the CPU: the engine's greedy tokens equal HF transformers' when HF's keys
(after rotary) and values are rounded through e4m3 the same way (saturated at +-448, nearest
even), and a pool of the same bytes holds twice (bf16) or four times (float32) the blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import bytes_per_block
from splitserve.engine.llm import LLM
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.hf_oracle import random_prompts

NEW_TOKENS = 12


def through_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


def hf_greedy_fp8_kv(model_dir: Path, arch: str, prompts: list[list[int]]) -> list[list[int]]:
    """HF's greedy tokens with every key and value stored as e4m3 would hold them."""
    import importlib

    from transformers import AutoModelForCausalLM

    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    rotary = module.apply_rotary_pos_emb

    def rotate_then_store(q, k, cos, sin, *args, **kwargs):  # type: ignore[no-untyped-def]
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, through_e4m3(k)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: through_e4m3(out))
        for layer in model.model.layers
    ]
    module.apply_rotary_pos_emb = rotate_then_store
    try:
        with torch.inference_mode():
            return [
                model.generate(
                    torch.tensor([p]),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
                for p in prompts
            ]
    finally:
        module.apply_rotary_pos_emb = rotary
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_kv_cache_matches_hf_with_e4m3_keys_and_values(
    tiny_models: dict[str, Path], arch: str
) -> None:
    llm = LLM(tiny_models[arch], device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=32)
    assert llm.engine.kv_cache.pool.dtype == torch.float8_e4m3fn
    prompts = random_prompts([6, 21, 45], vocab_size=200, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy_fp8_kv(tiny_models[arch], arch, prompts)


def test_an_fp8_pool_holds_more_blocks_in_the_same_bytes(tiny_models: dict[str, Path]) -> None:
    model = ModelConfig.from_pretrained(tiny_models["llama"])
    fp8 = bytes_per_block(model, 16, torch.float8_e4m3fn)
    assert bytes_per_block(model, 16, torch.bfloat16) == 2 * fp8
    budget = 1 << 20
    llm = LLM(tiny_models["llama"], device="cpu", kv_cache_memory_bytes=budget)
    llm8 = LLM(
        tiny_models["llama"], device="cpu", kv_cache_memory_bytes=budget, kv_cache_dtype="fp8"
    )
    assert llm8.engine.config.num_kv_blocks == 4 * llm.engine.config.num_kv_blocks  # vs fp32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
