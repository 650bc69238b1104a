"""HF transformers on the same weights: the oracle the engine's outputs are compared with."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=8)
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """Greedy tokens from HF `generate`, one prompt at a time (no padding), EOS ignored."""
    return list(_hf_greedy_cached(model_dir, prompt, max_new_tokens))


@lru_cache(maxsize=512)
def _hf_greedy_cached(model_dir: Path, prompt: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    return greedy_tokens(hf_model(model_dir), prompt, max_new)


@torch.inference_mode()
def greedy_tokens(model: torch.nn.Module, prompt: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    """`model`'s greedy tokens from HF `generate` after `prompt` (no padding), EOS ignored."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return tuple(out[0, len(prompt) :].tolist())


@torch.inference_mode()
def hf_logprobs(model_dir: Path, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at each position that predicts a continuation token:
    [len(continuation), vocab]."""
    ids = torch.tensor([prompt + continuation])
    logits = hf_model(model_dir)(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def assert_matches_hf(model_dir: Path, prompts, outputs, steps: int) -> None:
    """Each output's first sample is HF's greedy continuation of its prompt, `steps` tokens."""
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), steps), (
            f"prompt of {len(prompt)} tokens diverged from HF"
        )


def assert_engine_clean(llm) -> None:
    """The engine's block pool is consistent and holds nothing once every request ended."""
    llm.engine.check_integrity()
    usage = llm.engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_sequences == 0
