"""Plain-torch paged attention with the Triton kernels' signatures: the oracle the kernels are
tested against. Slow (a Python loop over sequences) and exact (float32 math throughout).

    context of sequence i:  [ cached prefix ........ | this step's queries ]
                            0                 seq_len - query_len      seq_len
    query j sits at position seq_len - query_len + j and sees keys at positions p with
    p <= its position and, with a window, p > its position - sliding_window.

With `sinks` (float32 [num_heads], gpt-oss), each head's softmax gets one more logit, the sink,
in its denominator only: its value column is dropped (HF's eager attention concatenates it to
the logits, softmaxes, and drops that column).
"""

from __future__ import annotations

import torch


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Keys and values of one sequence's first `seq_len` tokens: [2, seq_len, kv_heads, dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    pages = kv_cache[:, block_table[:num_blocks].long()]
    return pages.reshape(2, -1, kv_cache.shape[3], kv_cache.shape[4])[:, :seq_len]


def _attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q: [n, H, D] at `q_positions` [n]; kv: [2, L, Hkv, D]; sinks: [H] or None. Returns
    [n, H, D] float32."""
    group = q.shape[1] // kv.shape[2]
    keys = kv[0].float().repeat_interleave(group, dim=1)
    values = kv[1].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    k_positions = torch.arange(kv.shape[1], device=q.device)
    visible = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        visible &= q_positions[:, None] - k_positions[None, :] < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, values)


def decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `decode_attention` (max_seq_len and num_splits only tune the kernel)."""
    if out is None:
        out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[i] = 0
            continue
        kv = _gather(kv_cache, block_tables[i], seq_len)
        position = torch.tensor([seq_len - 1], device=q.device)
        attended = _attend(q[i : i + 1], kv, position, scale, sliding_window, sinks)
        out[i] = attended[0].to(out.dtype)
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `prefill_attention` (max_query_len only sizes the kernel's grid)."""
    if out is None:
        out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        kv = _gather(kv_cache, block_tables[i], seq_len)
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        attended = _attend(q[start:end], kv, positions, scale, sliding_window, sinks)
        out[start:end] = attended.to(out.dtype)
    return out
