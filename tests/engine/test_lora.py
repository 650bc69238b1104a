"""LoRA adapters (peft format) through the offline engine: greedy float32 outputs equal HF +
peft with the same adapter, for a batch mixing three adapters and base rows, on every tiny
architecture; adapters swap through fewer device slots than adapters; the prefix cache never
serves a block computed under one adapter to another (or to the base model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.errors import FailedPrecondition, InvalidRequest, NotFound
from splitserve.engine.lora import LoRARequest
from splitserve.testing.tiny_lora import make_tiny_lora
from tests.engine.hf_oracle import hf_greedy, random_prompts
from tests.engine.lora_oracle import peft_greedy

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Three adapters unlike each other: every projection at rank 8; attention only at rank 4 with
# rsLoRA; the MLP only at rank 16.
ADAPTERS = {
    "all": dict(rank=8, alpha=16),
    "attn": dict(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj"),
                 use_rslora=True),
    "mlp": dict(rank=16, alpha=16, target_modules=("gate_proj", "up_proj", "down_proj")),
}  # fmt: skip
# Which adapter each prompt runs under (None: the base model).
MIX = ["all", None, "attn", "mlp", "all", None]
LENGTHS = [5, 17, 40, 9, 33, 21]


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("loras")
    return {
        arch: {
            name: make_tiny_lora(tiny_models[arch], root / arch / name, seed=i + 1, **spec)
            for i, (name, spec) in enumerate(ADAPTERS.items())
        }
        for arch in ARCHS
    }


def _llm(model_dir: Path, loras: dict[str, Path], **options) -> LLM:
    modules = tuple((name, str(path)) for name, path in loras.items())
    return LLM(model_dir, lora_modules=modules, **options)


def _oracle(model_dir: Path, loras: dict[str, Path], prompt: list[int], name: str | None):
    if name is None:
        return hf_greedy(model_dir, tuple(prompt), MAX_NEW)
    return peft_greedy(model_dir, loras[name], prompt, MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_adapter_batch_matches_peft(tiny_models, adapters, arch):
    model_dir, loras = tiny_models[arch], adapters[arch]
    llm = _llm(model_dir, loras, max_loras=3)
    prompts = random_prompts(LENGTHS, llm.engine.model_config.vocab_size, seed=7)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=MIX)
    for prompt, name, out in zip(prompts, MIX, outputs, strict=True):
        want = _oracle(model_dir, loras, prompt, name)
        assert out.outputs[0].token_ids == want, f"adapter {name} diverged from HF + peft"
    # The adapters do change the output: each one's tokens differ from the base model's.
    for name in ADAPTERS:
        i = MIX.index(name)
        assert outputs[i].outputs[0].token_ids != hf_greedy(model_dir, tuple(prompts[i]), MAX_NEW)
    llm.engine.check_integrity()


def test_adapters_swap_through_fewer_slots_in_lru_order(tiny_models, adapters):
    # One device slot for three adapters: steps never mix two adapters, each swap-in evicts.
    model_dir, loras = tiny_models["llama"], adapters["llama"]
    llm = _llm(model_dir, loras, max_loras=1)
    prompts = random_prompts(LENGTHS, llm.engine.model_config.vocab_size, seed=7)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=MIX)
    for prompt, name, out in zip(prompts, MIX, outputs, strict=True):
        assert out.outputs[0].token_ids == _oracle(model_dir, loras, prompt, name)
    lora = llm.engine.lora
    assert lora is not None and lora.num_swaps >= 3 and len(lora.resident()) == 1


def test_prefix_is_not_shared_across_adapters(tiny_models, adapters):
    model_dir, loras = tiny_models["qwen3"], adapters["qwen3"]
    llm = _llm(model_dir, loras, max_loras=3)
    engine = llm.engine
    prefix = random_prompts([64], engine.model_config.vocab_size, seed=3)[0]
    prompt = prefix + [5, 6, 7]

    first: dict[str | None, list[int]] = {}

    def hits_after(name: str | None) -> int:
        before = engine.stats().prefix_cache_hits
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=name)[0]
        # A run that reused blocks gives what the first run under that adapter gave.
        assert first.setdefault(name, out.outputs[0].token_ids) == out.outputs[0].token_ids
        return engine.stats().prefix_cache_hits - before

    assert hits_after("all") == 0
    assert hits_after("attn") == 0  # same tokens, another adapter: computed again
    assert hits_after(None) == 0  # nor does the base model take an adapter's blocks
    assert hits_after("all") == 64  # the same adapter reuses its own (4 full blocks)
    assert hits_after(None) == 64
    assert first["all"] == _oracle(model_dir, loras, prompt, "all")


def test_unknown_adapter_is_not_found_with_its_name(tiny_models, adapters):
    llm = _llm(tiny_models["llama"], adapters["llama"])
    with pytest.raises(NotFound, match="'nope'"):
        llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False, lora_request="nope")
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequest, match="serves no adapters"):
        LLM(tiny_models["llama"]).generate([[3, 4]], GREEDY, use_tqdm=False, lora_request="all")


def test_load_at_run_time_and_unload_refused_while_in_use(tiny_models, adapters):
    model_dir, loras = tiny_models["llama"], adapters["llama"]
    llm = LLM(model_dir, enable_lora=True)
    engine = llm.engine
    assert engine.list_loras() == []
    # A request may name the path of an adapter not yet loaded (vLLM's LoRARequest).
    request = LoRARequest("all", 1, str(loras["all"]))
    prompt = [7, 8, 9, 10]
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)[0]
    assert out.outputs[0].token_ids == _oracle(model_dir, loras, prompt, "all")
    engine.add_lora("mlp", str(loras["mlp"]))
    assert engine.list_loras() == ["all", "mlp"]
    engine.add_request(prompt, GREEDY, request_id="busy", lora_request="mlp")
    with pytest.raises(FailedPrecondition, match="in use by 1 request"):
        engine.remove_lora("mlp")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("mlp")
    assert engine.list_loras() == ["all"]
    with pytest.raises(NotFound):
        engine.remove_lora("mlp")


def test_rank_above_the_limit_is_refused(tiny_models, adapters):
    with pytest.raises(InvalidRequest, match="rank 16 is above --max-lora-rank 8"):
        _llm(tiny_models["llama"], {"mlp": adapters["llama"]["mlp"]}, max_lora_rank=8)
