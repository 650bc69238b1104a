"""Argument checks shared by the kernel wrappers: a clear ValueError before any launch.

A Triton kernel given a wrong stride or dtype does not fail, it reads the wrong memory; so every
wrapper states what it needs and checks it here first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)
"""What a paged KV cache may hold: the model's dtype, or FP8 (e4m3, scale 1) in any model."""


def is_interpreted(kernel: Any) -> bool:
    """Whether `kernel` runs in Triton's interpreter (TRITON_INTERPRET=1 when it was defined)."""
    return isinstance(kernel, InterpretedFunction)


def check_tensor(
    name: str,
    t: Any,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = False,
) -> None:
    """Raise ValueError unless `t` is a tensor with the given rank, dtype, shape (None = any
    size in that dimension) and a unit stride in its last dimension (or fully contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            raise ValueError(f"{name} must have dtype in {allowed}, got {t.dtype}")
    if shape is not None and not _shape_matches(tuple(t.shape), shape):
        want_str = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want_str}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {t.stride()}")


def _shape_matches(got: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    return len(got) == len(want) and all(
        w is None or g == w for g, w in zip(got, want, strict=True)
    )


def check_devices(kernel: Any, **tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device, which must be a GPU unless `kernel` is interpreted."""
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name}: {t.device}" for name, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    device = devices.pop()
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; on a CPU set TRITON_INTERPRET=1 "
            "before triton is imported"
        )
    return device


def check_paged_cache(name: str, kv_cache: Any, dtype: torch.dtype | None = None) -> None:
    """A layer's paged cache: [2, num_blocks, block_size, num_kv_heads, head_dim], each block's
    [block_size, heads, dim] dense; the key/value planes and the blocks may be strided (a view
    of the block-major pool)."""
    check_tensor(name, kv_cache, ndim=5, dtypes=(dtype,) if dtype else KV_DTYPES)
    if kv_cache.shape[0] != 2:
        raise ValueError(f"{name} must have 2 (key, value) planes, got {kv_cache.shape[0]}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    dense = (num_kv_heads * head_dim, head_dim, 1)
    if block_size > 1 and tuple(kv_cache.stride()[2:]) != dense:
        raise ValueError(
            f"{name} must hold each block densely (slot, head, dim strides {dense}), "
            f"got strides {kv_cache.stride()}"
        )


def check_attention(q: Any, kv_cache: Any, sliding_window: int | None) -> tuple[int, int]:
    """q [tokens, num_heads, head_dim] against its paged cache [2, num_blocks, block_size,
    num_kv_heads, head_dim] (see `check_paged_cache`, q's dtype); returns (block_size,
    num_kv_heads)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_paged_cache("kv_cache", kv_cache)
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(
            f"kv_cache must have dtype {q.dtype} (q's) or torch.float8_e4m3fn, got {kv_cache.dtype}"
        )
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if kv_cache.shape[-1] != head_dim:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit q {tuple(q.shape)}")
    # The kernels tile the head dimension whole, and `tl.dot` needs at least 16.
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return block_size, num_kv_heads


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 ("ieee") for float32 tensors, so float32 results
    match the reference instead of TF32's 10-bit mantissa; the hardware default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
