"""HF transformers + peft on the same base weights and adapter: the oracle for LoRA outputs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=16)
def peft_model(model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    # A fresh base each time: peft wraps the modules of the model it is given.
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@torch.inference_mode()
def peft_greedy(
    model_dir: Path, adapter_dir: Path, prompt: list[int], max_new_tokens: int
) -> list[int]:
    """Greedy tokens from HF + peft `generate`, one prompt at a time, EOS ignored."""
    out = peft_model(model_dir, adapter_dir).generate(
        input_ids=torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
