"""GGUF files written the way llama.cpp's converter writes them, for tests that must run offline.

`write_gguf` takes HF-named tensors and writes llama.cpp's names, metadata keys, Q/K row
permutation (for `llama`) and block quantization (`gguf.quants.quantize`, for the types that
have one); `random_blocks` makes valid quantized bytes for the types `gguf` can only
dequantize (the K-quants). `hf_to_gguf` turns a tiny HF checkpoint (testing/tiny_model.py),
tokenizer included, into a GGUF file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Byte offsets of the float16 scale fields in one block of each type (ggml-common.h): random
# bytes there could be NaN or huge, so `random_blocks` writes sane scales over them.
_SCALE_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(frozen=True)
class RawTensor:
    """Bytes already in GGUF layout (rows of quantized blocks), written as they are."""

    data: np.ndarray  # uint8, (rows, bytes per row)
    qtype: str


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): HF halves -> interleaved."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> RawTensor:
    """Random but valid quantized data of `qtype` for a (rows, cols) tensor."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        scales = np.asarray(rng.uniform(1e-3, 2e-2, blocks.shape[0]), dtype=np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return RawTensor(blocks.reshape(rows, -1), qtype)


def write_gguf(
    path: str | Path,
    arch: str,
    config: dict[str, Any],
    tensors: dict[str, np.ndarray | RawTensor],
    qtype: str = "F32",
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write `tensors` (HF names; float arrays in HF layout, or RawTensor) as a GGUF file of
    `arch`: 2-D float weights in `qtype`, norms and biases in F32, as llama.cpp does."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if tokenizer_dir is not None:
        _add_tokenizer(writer, tokenizer_dir, config)
    for name, tensor in tensors.items():
        if isinstance(tensor, RawTensor):
            writer.add_tensor(
                gguf_name(name), tensor.data, raw_dtype=gguf.GGMLQuantizationType[tensor.qtype]
            )
            continue
        array = np.asarray(tensor, dtype=np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        kind = gguf.GGMLQuantizationType[qtype if array.ndim == 2 else "F32"]
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), array)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _add_tokenizer(writer: Any, tokenizer_dir: Path, config: dict[str, Any]) -> None:
    """A byte-level BPE tokenizer.json as GGUF's `gpt2` tokenizer (tokens, types, merges)."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if tok in special else 1 for tok in tokens])  # 3: control
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("pad_token_id", writer.add_pad_token_id),
    ):
        if config.get(key) is not None:
            add(config[key])
    writer.add_add_bos_token(False)
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def hf_to_gguf(model_dir: str | Path, path: str | Path, qtype: str = "F32") -> Path:
    """The tiny HF checkpoint in `model_dir` (one safetensors file) as a GGUF file."""
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    arch = "llama" if arch == "mistral" else arch  # as llama.cpp writes Mistral
    tensors = load_file(str(model_dir / "model.safetensors"))
    return write_gguf(path, arch, config, dict(tensors), qtype, tokenizer_dir=model_dir)
