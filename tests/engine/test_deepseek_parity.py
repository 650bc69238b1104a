"""DeepSeek-V2 and -V3 (Multi-head Latent Attention, DeepSeek MoE): greedy float32 outputs are
token-identical to HF transformers over 64 steps (plain batches, chunked prefill, prefix-cache
hits, preemption), the KV cache holds one latent per token and layer, and what the family cannot
run with yet is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.common import SHAPES
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.kv_cache import bytes_per_block
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.spec_decode.config import SpeculativeConfig
from splitserve.engine.weights import iter_tensors
from splitserve.testing.tiny_deepseek import TINY_DEEPSEEK, make_tiny_deepseek_model
from tests.engine.hf_oracle import (
    assert_engine_clean,
    assert_matches_hf,
    hf_model,
    random_prompts,
)

STEPS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
# Across block edges (16 tokens) and past YaRN's original context (64 positions).
LENGTHS = [1, 7, 17, 50, 130]


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {v: make_tiny_deepseek_model(root / v, v) for v in TINY_DEEPSEEK}


@pytest.mark.parametrize("variant", TINY_DEEPSEEK)
def test_greedy_batch_and_chunked_prefill_match_hf(deepseek_models, variant):
    model_dir = deepseek_models[variant]
    whole, chunked = LLM(model_dir), LLM(model_dir, max_num_batched_tokens=24)
    prompts = random_prompts(LENGTHS, whole.engine.model_config.vocab_size)
    assert_matches_hf(model_dir, prompts, whole.generate(prompts, GREEDY, use_tqdm=False), STEPS)
    assert_matches_hf(model_dir, prompts, chunked.generate(prompts, GREEDY, use_tqdm=False), STEPS)
    assert_engine_clean(whole)
    assert_engine_clean(chunked)


# DeepSeek-V2-Lite's routing: one group, a softmax top-k never renormalised (the fused router's
# path on a GPU, its torch reference here), scaled.
V2_GREEDY = {"topk_method": "greedy", "n_group": 1, "topk_group": 1}


def test_v2_greedy_routing_matches_hf(tmp_path):
    model_dir = make_tiny_deepseek_model(tmp_path / "v2", "deepseek_v2", config_overrides=V2_GREEDY)
    llm = LLM(model_dir)
    moe = llm.engine.model_config.moe
    assert moe is not None and moe.num_groups == 1 and moe.routed_scaling_factor != 1.0
    prompts = random_prompts(LENGTHS, llm.engine.model_config.vocab_size, seed=4)
    assert_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), STEPS)
    assert_engine_clean(llm)


@pytest.mark.parametrize("variant", TINY_DEEPSEEK)
def test_prefix_hits_and_preemption_match_hf(deepseek_models, variant):
    model_dir = deepseek_models[variant]
    llm = LLM(model_dir, num_kv_blocks=24)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([40], vocab, seed=7)[0]
    prompts = [shared + s for s in random_prompts([3, 21, 60, 9, 33], vocab, seed=8)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert_matches_hf(model_dir, prompts, first + rest, STEPS)
    assert all(out.num_cached_tokens == 32 for out in rest)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_engine_clean(llm)


def test_config_matches_hf(deepseek_models):
    """The softmax scale (YaRN's mscale folded in), routing and shapes as transformers reads
    them; the checkpoint's multi-token-prediction layer is there (and ignored at load)."""
    for variant, model_dir in deepseek_models.items():
        cfg = ModelConfig.from_pretrained(model_dir)
        hf = hf_model(model_dir)
        assert cfg.mla is not None and cfg.moe is not None
        assert cfg.mla.softmax_scale == hf.model.layers[0].self_attn.scaling
        assert cfg.head_dim == hf.config.qk_rope_head_dim
        assert cfg.moe.dense_layers == (0,)
        assert cfg.moe.num_groups == 4 and cfg.moe.topk_groups == 2
        v3 = variant == "deepseek_v3"
        assert cfg.moe.router == ("deepseek_sigmoid" if v3 else "deepseek_softmax")
        assert cfg.mla.rope_layout == ("interleave" if v3 else "complex")
        assert cfg.mla.q_lora_rank == (48 if v3 else None)
        names = {name for name, _ in iter_tensors(model_dir)}
        assert any(name.startswith(f"model.layers.{cfg.num_layers}.") for name in names)


def test_kv_cache_holds_one_latent_per_token_and_layer(deepseek_models):
    llm = LLM(deepseek_models["deepseek_v3"], num_kv_blocks=8)
    cfg, cache = llm.engine.model_config, llm.engine.kv_cache
    assert cfg.mla is not None
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    assert tuple(cache.pool.shape) == (8, cfg.num_layers, 1, 16, 1, latent)
    per_token = latent * cache.pool.element_size() * cfg.num_layers
    assert cache.block_bytes == per_token * 16
    assert bytes_per_block(cfg, 1, torch.float32) == per_token == (32 + 8) * 4 * 3


def test_deepseek_v2_lite_bytes_per_token():
    """DeepSeek-V2-Lite's shape: (512 + 64) values x 2 bytes x 27 layers a token in bf16, where
    per-head keys and values would take 16 heads x (192 + 128) x 2 x 27 = 276,480."""
    # NOTE: the shape the GPU benchmarks run (bench/common.py), as its config.json has it
    cfg = ModelConfig.from_hf_dict(SHAPES["deepseek-v2-lite"])
    assert bytes_per_block(cfg, 1, torch.bfloat16) == 31_104
    assert cfg.moe is not None and cfg.moe.num_groups == 1  # "greedy": no groups
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert cfg.mla is not None
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale)


@pytest.mark.parametrize(
    "options, what",
    [
        ({"speculative": SpeculativeConfig("ngram", num_speculative_tokens=2)}, "speculative"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"enable_lora": True}, "LoRA"),
        ({"quantization": "fp8"}, "quantization"),
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
    ],
)
def test_unsupported_paths_are_refused(deepseek_models, options, what):
    with pytest.raises(ValueError, match=f"DeepseekV3ForCausalLM.*{what}"):
        LLM(deepseek_models["deepseek_v3"], **options)


def test_kv_transfer_region_is_the_latent_page(deepseek_models):
    """What a transport registers: one plane of one latent-wide row per token and layer, a
    block's bytes those of its latents (tests/e2e/test_deepseek_disaggregated.py moves them)."""
    llm = LLM(deepseek_models["deepseek_v2"], num_kv_blocks=4)
    cfg = llm.engine.model_config
    assert cfg.mla is not None
    region = llm.engine.kv_connector.region()
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    assert region.page == (1, region.block_size, 1, latent)
    assert region.block_bytes == cfg.num_layers * region.block_size * latent * 4  # float32


def test_stacked_expert_checkpoint_loads_as_per_expert_one(deepseek_models, tmp_path):
    """Experts stored stacked ([E, 2I, H] gate|up, [E, H, I]), as transformers holds them in
    memory, load into the same parameters as the per-expert tensors transformers saves."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = deepseek_models["deepseek_v3"]
    stacked_dir = tmp_path / "stacked"
    shutil.copytree(source, stacked_dir)
    tensors = load_file(str(stacked_dir / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(source)
    assert cfg.moe is not None
    for layer in range(cfg.moe.dense_layers[-1] + 1, cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        experts = range(cfg.moe.num_experts)
        tensors[f"{p}gate_up_proj"] = torch.stack([
            torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"),
                       tensors.pop(f"{p}{e}.up_proj.weight")])
            for e in experts
        ])  # fmt: skip
        tensors[f"{p}down_proj"] = torch.stack(
            [tensors.pop(f"{p}{e}.down_proj.weight") for e in experts]
        )
    save_file(tensors, str(stacked_dir / "model.safetensors"), metadata={"format": "pt"})
    prompt = random_prompts([20], cfg.vocab_size, seed=5)
    few = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llms = [LLM(d) for d in (source, stacked_dir)]
    outputs = [llm.generate(prompt, few, use_tqdm=False)[0].outputs[0] for llm in llms]
    assert outputs[0].token_ids == outputs[1].token_ids
    a, b = (llm.engine.model.model.layers[1].mlp for llm in llms)
    assert torch.equal(a.experts.gate_up_proj, b.experts.gate_up_proj)
    assert torch.equal(a.experts.down_proj, b.experts.down_proj)
