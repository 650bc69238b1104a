"""A tiny Gemma 3 GGUF file written the way llama.cpp's converter writes one, for offline tests.

Random weights under HF's names go to llama.cpp's (the `gguf` package's own tensor name map for
GEMMA3, not ours), with 1 added to every norm weight as `Gemma3Model.modify_tensors` does; the
metadata keys are the ones its `set_gguf_parameters` writes (no sliding-window pattern, no local
RoPE base: llama.cpp's loader knows those). The tokenizer is a small SentencePiece-style
vocabulary (`tokenizer.ggml.model` "llama": pieces with `▁` for spaces, byte fallback tokens,
Gemma's special tokens at their ids) with a chat template, so that transformers' GGUF tokenizer
conversion (its `gemma_tokenizer`) has a real one to build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Gemma's turn markup, as its instruction-tuned models' template writes it (shortened).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 7,  # layer 5 full attention, the others sliding (6 shows the wrap)
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,  # as every Gemma 3 but the 27B: transformers assumes 256 for the scale
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "sliding_window": 16,
}

_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
_WORDS = ["the", "model", "user", "hello", "world", "is", "a", "of", "to", "in"]


def tiny_gemma3_vocab() -> tuple[list[str], list[int]]:
    """(tokens, llama.cpp token types): specials, every letter and a few whole words (with and
    without the leading `▁`), then the 256 byte fallback tokens."""
    pieces = ["▁", "\n", *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pieces += [*"0123456789.,!?:'()"]
    for word in _WORDS:
        pieces += [word[:i] for i in range(2, len(word) + 1)] + ["▁" + word]
    seen: dict[str, None] = dict.fromkeys(pieces)
    tokens = _SPECIAL + list(seen) + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(_SPECIAL) + [1] * len(seen) + [6] * 256  # control, normal, byte
    return tokens, types


def write_tiny_gemma3_gguf(
    path: str | Path, *, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0
) -> Path:
    """Write the tiny Gemma 3 GGUF (F32 tensors) to `path`."""
    import gguf

    cfg = CONFIG
    tokens, types = tiny_gemma3_vocab()
    layers = cfg["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0 if t != 1 else 0.0 for t in types])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, layers)
    for hf_name, array in _hf_tensors(len(tokens), seed).items():
        base, suffix = hf_name.rsplit(".", 1)
        if hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # Gemma3RMSNorm's `1 + w`, folded in
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _hf_tensors(vocab: int, seed: int) -> dict[str, np.ndarray]:
    cfg = CONFIG
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float = 0.05) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            tensors[p + norm + ".weight"] = normal(hidden, std=0.2)
        tensors[p + "self_attn.q_norm.weight"] = normal(head_dim, std=0.2)
        tensors[p + "self_attn.k_norm.weight"] = normal(head_dim, std=0.2)
        tensors[p + "self_attn.q_proj.weight"] = normal(q, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    tensors["model.norm.weight"] = normal(hidden, std=0.2)
    return tensors
