"""Writing a tiny random-weight checkpoint through transformers: the config (with the tiny
tokenizer's vocabulary and special ids), the model built from it, every parameter drawn by the
caller's rule from one seeded generator, the safetensors and the tokenizer files. The tiny
family and DeepSeek builders (tiny_families.py, tiny_deepseek.py) differ only in their configs
and draws."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from splitserve.testing.tiny_tokenizer import (
    BOS_TOKEN,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    build_tokenizer,
    write_tokenizer_files,
)

Draw = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


def write_hf_checkpoint(
    out_dir: str | os.PathLike,
    config: dict[str, Any],
    draw: Draw,
    seed: int,
    draw_buffer: Callable[[str, torch.Tensor, torch.Generator], None] | None = None,
) -> tuple[pathlib.Path, dict[str, Any], torch.Generator]:
    """Write `config` (HF config.json fields, the tokenizer's ids added) as a float32 model whose
    parameters are `draw(name, shape, gen)` (then `draw_buffer(name, buffer, gen)` on each
    buffer) into out_dir with the tiny tokenizer. Returns the directory, the config written and
    the generator, for whatever the caller draws next."""
    from transformers import AutoConfig, AutoModelForCausalLM  # NOTE: here: it loads torch

    tokenizer = build_tokenizer(qwen2_pipeline=False, add_bos=False)
    raw = {
        **config,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "pad_token_id": tokenizer.token_to_id(PAD_TOKEN),
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(draw(name, tuple(param.shape), gen))
        if draw_buffer is not None:
            for name, buffer in model.named_buffers():
                draw_buffer(name, buffer, gen)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer_files(
        out,
        tokenizer,
        model_max_length=raw["max_position_embeddings"],
        add_bos=False,
        chat_template=CHATML_TEMPLATE,
    )
    return out, raw, gen
