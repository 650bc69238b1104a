"""MXFP4 expert weights (gpt-oss checkpoints), dequantized at load.

A checkpoint stores each MoE projection as two tensors:

    <proj>_blocks  uint8 [num_experts, rows, num_groups, 16]  two FP4 (e2m1) values a byte,
                                                             the low nibble first
    <proj>_scales  uint8 [num_experts, rows, num_groups]      one E8M0 exponent (bias 127) per
                                                             group of 32 values

so row r of expert e holds, group after group, value = e2m1 * 2^(scale - 127). The result is laid
out as transformers' dequantized parameters (`convert_moe_packed_tensors` in
integrations/mxfp4.py), the groups' axis flattened and moved ahead of the rows:

    gate_up_proj_blocks [E, 2 * inter, hidden / 32, 16]  ->  gate_up_proj [E, hidden, 2 * inter]
    down_proj_blocks    [E, hidden, inter / 32, 16]      ->  down_proj    [E, inter, hidden]

(inter: the experts' intermediate size).

The arithmetic is transformers' own (the e2m1 value in the target dtype, then `torch.ldexp`, whose
product is float32 rounded once to the dtype), so the two agree bit for bit, also where a 16-bit
dtype overflows and where scale 255 (E8M0's NaN) meets a zero.
"""

from __future__ import annotations

import torch

__all__ = ["FP4_VALUES", "dequantize_mxfp4"]

# The 16 e2m1 codes: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
E8M0_BIAS = 127
# Rows (of one group each) dequantized at a time: bounds the int32 index temporaries to a few
# hundred MiB whatever the projection's size.
ROWS_PER_CHUNK = 1 << 21


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The dense `dtype` weight of an MXFP4 projection, on blocks' device: blocks uint8
    [E, rows, G, B] (B bytes, 2B values per group) and scales uint8 [E, rows, G] give
    [E, G * 2B, rows] (any dims between E and rows stay in place, as in transformers)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks [E, rows, groups, bytes] and scales [E, rows, groups] do not fit: "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    *prefix, num_groups, num_bytes = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    packed = blocks.reshape(-1, num_bytes)
    exponents = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    out = torch.empty(packed.shape[0], 2 * num_bytes, dtype=dtype, device=blocks.device)
    for start in range(0, packed.shape[0], ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        chunk = out[rows]
        # NOTE: int32 indices: a uint8 index tensor would be read as a boolean mask.
        chunk[:, 0::2] = lut[(packed[rows] & 0x0F).to(torch.int32)]
        chunk[:, 1::2] = lut[(packed[rows] >> 4).to(torch.int32)]
        torch.ldexp(chunk, exponents[rows], out=chunk)
    out = out.view(*prefix, num_groups * 2 * num_bytes)
    return out.transpose(1, 2).contiguous()
