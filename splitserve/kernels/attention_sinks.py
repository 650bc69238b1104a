"""Attention sinks (gpt-oss): a learned logit per query head that joins every softmax over that
head's keys in the denominator only (it has no value row), so a query may attend to "nothing".

    p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))

In an online softmax the sink is the state before the first key: running max = the sink's logit,
running sum = 1 (its own weight), accumulator = 0. Scores are base 2 in the kernels (the softmax
scale times log2(e) folded in), so the sink is multiplied by log2(e) alone: it is a logit already,
never scaled by 1/sqrt(head_dim).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import check_tensor

_LOG2E = tl.constexpr(math.log2(math.e))


@triton.jit
def sink_state(sinks_ptr, heads, mask):
    """(running max, running sum) of each row's online softmax before its first key: the sink
    of head `heads` (base 2) with weight 1 where `mask`, else (-inf, 0), no sink at all."""
    m = tl.load(sinks_ptr + heads, mask=mask, other=float("-inf")).to(tl.float32) * _LOG2E
    return m, tl.where(m == float("-inf"), 0.0, 1.0)


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """None, or one float32 logit per query head: [num_heads], contiguous."""
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), shape=(num_heads,), contiguous=True)
