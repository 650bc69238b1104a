"""Random LoRA adapters for the tiny test models, made and saved by `peft` itself.

`make_tiny_lora` wraps a tiny checkpoint in a peft `LoraConfig` with `init_lora_weights=False`
(both A and B random, so the adapter changes the output) and writes what `save_pretrained`
writes: `adapter_config.json` + `adapter_model.safetensors`. `peft` is a test dependency, so
it is imported here only when called.
"""

from __future__ import annotations

import os
import pathlib

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_lora(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    target_modules: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
) -> pathlib.Path:
    """Write a random peft LoRA adapter for the checkpoint in `model_dir` into `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    out = pathlib.Path(out_dir)
    model.save_pretrained(str(out))
    return out
