"""The whole engine on the Triton backend gives the torch backend's greedy tokens (float32):
plain batches, chunked prefill mixing prefill chunks with decodes, prefix-cache hits, and a
sliding-window model."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.testing.tiny_model import make_tiny_model
from tests.engine.hf_oracle import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt, and how many prompt tokens came from the prefix cache."""
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs], sum(o.num_cached_tokens for o in outputs)


@pytest.mark.parametrize(
    ("arch", "overrides", "options"),
    [
        ("llama", {}, {}),  # GQA 4 / 2 heads, Llama-3 rope
        ("llama", {}, {"max_num_batched_tokens": 16}),  # chunked prefill beside decodes
        ("mistral", {"sliding_window": 12}, {}),  # MHA with a window shorter than the prompts
    ],
    ids=["batch", "chunked", "window"],
)
def test_triton_backend_matches_torch_backend(tmp_path, arch, overrides, options):
    model_dir = make_tiny_model(tmp_path / arch, arch, config_overrides=overrides)
    common = {"num_kv_blocks": 64, "dtype": "float32", **options}
    torch_llm = LLM(model_dir, attention_backend="torch", **common)
    triton_llm = LLM(model_dir, attention_backend="triton", **common)
    prompts = random_prompts([5, 23, 40], torch_llm.engine.model_config.vocab_size, seed=11)
    backend = triton_llm.engine.model.model.layers[0].self_attn.backend
    assert type(backend).__name__ == "TritonPagedAttention"
    want, _ = _generate(torch_llm, prompts)
    got, num_cached = _generate(triton_llm, prompts)
    assert got == want and num_cached == 0
    # Again: the prompts' full blocks now come from the prefix cache.
    got, num_cached = _generate(triton_llm, prompts)
    assert got == want and num_cached > 0
