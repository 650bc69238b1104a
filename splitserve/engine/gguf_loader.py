"""Reading a GGUF checkpoint (llama.cpp's format) as a Hugging Face one: config and tensors.

GGUF keeps a model's shape in metadata keys (`llama.block_count`, …) and its tensors under
llama.cpp's names (`blk.0.attn_q.weight`), often quantized in blocks. Here those become what an
HF-format directory holds: a config.json dict and float tensors under HF names, so that every
loader downstream (engine, workers, the torch-free gateway) reads a GGUF model unchanged once
`gguf_cache` has written them out.

What the conversion to GGUF did is undone (each architecture's part: `gguf_archs`):
- quantization: each supported block type is dequantized with the `gguf` package's own
  reference (`gguf.quants.dequantize`), to float32;
- Gemma's norms: llama.cpp added 1 to every norm weight (`1 + w` folded in); it is subtracted;
- for the `llama` architecture, llama.cpp's converter permuted the rows of Q and K from HF's
  "rotate halves" layout to interleaved pairs (what its RoPE kernel expects):

      HF rows of one head:    [x0 x1 … x(d/2-1) | y0 y1 … y(d/2-1)]   (rotate_half pairs xi, yi)
      GGUF rows of one head:  [x0 y0 x1 y1 …]

  `unpermute_qk` puts them back.

The file's metadata and tensor table are read by `gguf_fields` (fast: `gguf.GGUFReader` spends
seconds walking a large vocabulary element by element); the tensor data stays in the file's map
until each tensor is dequantized. Only numpy and `gguf` are imported here (never torch): the
gateway reads GGUF models too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.engine.gguf_archs import (
    ARCHITECTURES,
    GGUFError,
    hf_config,
    hf_tensor_name,
    is_shifted_norm,
)
from splitserve.engine.gguf_fields import GGUFHeader, read_gguf

__all__ = ["ARCHITECTURES", "SUPPORTED_TYPES", "GGUFError", "GGUFModel", "unpermute_qk"]

# Tensor types dequantized at load (names as in `gguf.GGMLQuantizationType`).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


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
    header: GGUFHeader  # every key/value (the tokenizer's too) and the tensor table

    @classmethod
    def open(cls, path: str | Path) -> GGUFModel:
        """Read `path`'s metadata; raise GGUFError naming an unsupported architecture or tensor
        type (every tensor is checked here, before anything is converted)."""
        path = Path(path)
        header = read_gguf(path)
        fields = header.fields
        metadata = {key: value for key, value in fields.items()
                    if not key.startswith("tokenizer.ggml.")}  # fmt: skip
        arch = str(metadata.get("general.architecture"))
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"{path.name}: unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        bad = sorted(
            {t.tensor_type.name for t in header.tensors} - set(SUPPORTED_TYPES),
        )
        if bad:
            examples = [t.name for t in header.tensors if t.tensor_type.name in bad][:3]
            raise GGUFError(
                f"{path.name}: unsupported GGUF tensor type(s) {', '.join(bad)} (e.g. "
                f"{', '.join(examples)}); supported: {', '.join(SUPPORTED_TYPES)}"
            )
        names = {t.name for t in header.tensors}
        if "rope_freqs.weight" in names:
            raise GGUFError(
                f"{path.name}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1-style "
                "scaling) are not supported"
            )
        unknown = sorted(n for n in names if hf_tensor_name(arch, n) is None)
        if unknown:
            raise GGUFError(f"{path.name}: tensors with no known meaning: {unknown[:5]}")
        special_ids = {
            name: int(fields[key])
            for name in ("bos", "eos", "padding")
            if (key := f"tokenizer.ggml.{name}_token_id") in fields
        }
        num_tokens = len(fields.get("tokenizer.ggml.tokens", ()))
        config = hf_config(arch, metadata, names, num_tokens, special_ids, path.name)
        return cls(path, arch, config, metadata, header)

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.model" in self.header.fields

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float array) for every tensor: dequantized, Q/K permutation and norm
        shift undone. F16 tensors stay float16 (exact); everything else is float32 (exact for
        every block type; a shifted norm is float32 whatever it was stored as)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        spec = ARCHITECTURES[self.arch]
        cfg = self.hf_config
        for tensor in self.header.tensors:
            name = hf_tensor_name(self.arch, tensor.name)
            assert name is not None  # checked in open()
            shape = tensor.shape  # numpy's order (GGUF lists dims innermost first)
            data = self.header.tensor_data(tensor)
            if tensor.tensor_type == GGMLQuantizationType.F16:
                array = data.view(np.float16).reshape(shape)
            else:
                array = dequantize(data, tensor.tensor_type).reshape(shape)
            if is_shifted_norm(self.arch, tensor.name):
                array = array.astype(np.float32) - np.float32(spec.norm_shift)
            if spec.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
                array = unpermute_qk(array, cfg["num_attention_heads"])
            elif spec.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
                array = unpermute_qk(array, cfg["num_key_value_heads"])
            yield name, np.ascontiguousarray(array)
