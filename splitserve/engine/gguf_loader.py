"""Reading a GGUF checkpoint (llama.cpp's format) as a Hugging Face one: config and tensors.

GGUF keeps a model's shape in metadata keys (`llama.block_count`, …) and its tensors under
llama.cpp's names (`blk.0.attn_q.weight`), often quantized in blocks. Here those become what an
HF-format directory holds: a config.json dict and float tensors under HF names, so that every
loader downstream (engine, workers, the torch-free gateway) reads a GGUF model unchanged once
`gguf_cache` has written them out.

Two things the conversion to GGUF did are undone:
- quantization: each supported block type is dequantized with the `gguf` package's own
  reference (`gguf.quants.dequantize`), to float32;
- for the `llama` architecture, llama.cpp's converter permuted the rows of Q and K from HF's
  "rotate halves" layout to interleaved pairs (what its RoPE kernel expects):

      HF rows of one head:    [x0 x1 … x(d/2-1) | y0 y1 … y(d/2-1)]   (rotate_half pairs xi, yi)
      GGUF rows of one head:  [x0 y0 x1 y1 …]

  `unpermute_qk` puts them back.

Only numpy and `gguf` are imported here (never torch): the gateway reads GGUF models too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF `general.architecture` -> (HF architecture, were Q/K permuted by llama.cpp's converter).
# Mistral checkpoints are written as `llama` by llama.cpp.
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# Tensor types dequantized at load (names as in `gguf.GGMLQuantizationType`).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


class GGUFError(ValueError):
    """A GGUF file this engine cannot run (its architecture, a tensor type, a missing key)."""


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None when llama.cpp's name has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a Q or K projection (weight or bias) of `num_heads` heads
    (the KV heads for K): interleaved rotary pairs back to HF's halves."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(weight.shape))


@dataclass
class GGUFModel:
    """An opened GGUF file: its HF config and a way to read its tensors under HF names."""

    path: Path
    arch: str  # the GGUF architecture ("llama", …)
    hf_config: dict[str, Any]
    metadata: dict[str, Any]
    _reader: Any

    @classmethod
    def open(cls, path: str | Path) -> GGUFModel:
        """Read `path`'s metadata; raise GGUFError naming an unsupported architecture or tensor
        type (every tensor is checked here, before anything is converted)."""
        import gguf  # NOTE: here, so that importing this module stays cheap

        path = Path(path)
        try:
            reader = gguf.GGUFReader(str(path))
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{str(path)!r} is not a readable GGUF file: {exc}") from None
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith(("tokenizer.ggml.", "GGUF."))
        }
        arch = str(metadata.get("general.architecture"))
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"{path.name}: unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        bad = sorted(
            {t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES),
        )
        if bad:
            examples = [t.name for t in reader.tensors if t.tensor_type.name in bad][:3]
            raise GGUFError(
                f"{path.name}: unsupported GGUF tensor type(s) {', '.join(bad)} (e.g. "
                f"{', '.join(examples)}); supported: {', '.join(SUPPORTED_TYPES)}"
            )
        names = {t.name for t in reader.tensors}
        if "rope_freqs.weight" in names:
            raise GGUFError(
                f"{path.name}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1-style "
                "scaling) are not supported"
            )
        unknown = sorted(n for n in names if hf_tensor_name(n) is None)
        if unknown:
            raise GGUFError(f"{path.name}: tensors with no known meaning: {unknown[:5]}")
        config = _hf_config(arch, metadata, names, path.name, reader)
        return cls(path, arch, config, metadata, reader)

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.model" in self._reader.fields

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float array) for every tensor: dequantized, Q/K permutation undone. F16
        tensors stay float16 (exact); everything else is float32 (exact for every block type)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        _, permuted = ARCHITECTURES[self.arch]
        cfg = self.hf_config
        for tensor in self._reader.tensors:
            name = hf_tensor_name(tensor.name)
            assert name is not None  # checked in open()
            # GGUF lists dims innermost first; numpy (and torch) want them outermost first.
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            if tensor.tensor_type == GGMLQuantizationType.F16:
                array = np.asarray(tensor.data).view(np.float16).reshape(shape)
            else:
                array = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
            if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                array = unpermute_qk(array, cfg["num_attention_heads"])
            elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                array = unpermute_qk(array, cfg["num_key_value_heads"])
            yield name, np.ascontiguousarray(array)


def _hf_config(
    arch: str, meta: dict[str, Any], tensor_names: set[str], source: str, reader: Any
) -> dict[str, Any]:
    """config.json for the GGUF's metadata (the keys llama.cpp writes for these families)."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{source}: metadata key {arch}.{name} is missing")
        return value

    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per layer; only a uniform count can run here
        if len(set(num_kv_heads)) != 1:
            raise GGUFError(f"{source}: a KV head count that varies by layer is not supported")
        num_kv_heads = num_kv_heads[0]
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"{source}: partial rotary ({rope_dim} of {head_dim} dims) unsupported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{source}: RoPE scaling {scaling!r} is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf_arch, _ = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
    }
    if arch != "llama":
        config["use_sliding_window"] = False
    for name in ("bos", "eos", "padding"):
        field = reader.fields.get(f"tokenizer.ggml.{name}_token_id")
        if field is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(
                field.contents()
            )
    return config
