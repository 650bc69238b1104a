"""Triton kernels for the engine's hot paths, each beside a plain-torch reference.

Every module holds one kernel (or one kernel pair) with three layers:

- `_*_kernel`: the `@triton.jit` function; it trusts its arguments.
- the public wrapper (`decode_attention`, `rms_norm`, …): typed, checks shapes, dtypes, devices
  and strides and raises a clear `ValueError` before anything is launched, then picks block
  sizes and launches.
- `*_ref`: the same signature in plain torch, computed the obvious way; tests compare the two.

| module | public API |
| --- | --- |
| `kv_cache_write` | `write_kv_cache`, `write_kv_cache_ref` |
| `decode_attention` | `decode_attention`, `decode_attention_ref`, `choose_num_splits` |
| `prefill_attention` | `prefill_attention`, `prefill_attention_ref` |
| `rmsnorm` | `rms_norm`, `fused_add_rms_norm`, `*_fp8` (quantized rows) (+ `_ref`) |
| `rotary` | `rotary_embedding`, `rotary_embedding_write_kv` (+ `_ref`) |
| `activation` | `silu_and_mul`, `silu_and_mul_fp8` (quantized rows) (+ `_ref`) |
| `gemv` | `gemv`, `gemv_ref`, `pick_config` |
| `fp8_quant` | `quantize_rows`, `quantize_rows_ref` (FP8 activations, per token or static) |
| `fp8_skinny` | `skinny_fp8_gemm`, `skinny_fp8_gemm_ref`, `pick_config`, `split_for` |
| `argmax` | `argmax_rows`, `argmax_rows_ref` |
| `lora` | `lora_shrink`, `lora_expand` (batched LoRA by segment; reference in `lora_ref`) |

`decode_tiles` and `decode_merge` are parts of the decode attention (a key tile; the merge of
its splits), `attention_sinks` what both attention kernels do with gpt-oss's sink logits.
`pdl` is shared launch plumbing, not a kernel: on Hopper and newer every kernel here except the
prefill attention is launched with programmatic dependent launch (see its docstring).

On a machine without a GPU, set `TRITON_INTERPRET=1` before triton is first imported and pass
CPU tensors: the kernels then run (slowly) in Triton's interpreter.
"""
