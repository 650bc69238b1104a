"""Plain-torch paged attention: the reference backend, on CPU and GPU alike.

It gathers each sequence's pages into a contiguous K/V and runs SDPA with a causal (and, for
Mistral-style models, sliding-window) mask whose diagonal is shifted by the cached prefix:

    context:  [ cached prefix ........ | this step's queries ]
    query j sits at position seq_len - query_len + j and sees keys 0..that position.

With attention sinks (gpt-oss) the softmax is written out instead of SDPA, as HF's eager
attention computes it: the sink joins the logits as one more column, the row's max is
subtracted, and the sink's column is dropped after the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.kernels.fp8_ref import saturate_fp8


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's key and value at its flat slot (block * block_size + offset); an FP8
    cache (e4m3, scale 1) holds them saturated at +-448 and rounded to nearest even. Slot -1
    is a padding token (a static batch's spare query, engine/spec_decode/graphs.py): skipped,
    as the Triton kernels skip it."""
    block_size = kv_cache.shape[2]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    pages, offsets = slot_mapping // block_size, slot_mapping % block_size
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    kv_cache[0][pages, offsets] = saturate_fp8(k) if fp8 else k
    kv_cache[1][pages, offsets] = saturate_fp8(v) if fp8 else v


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first `seq_len` tokens: [seq_len, kv_heads, head_dim]."""
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    shape = (-1, kv_cache.shape[-2], kv_cache.shape[-1])
    keys = kv_cache[0][blocks].reshape(shape)[:seq_len]
    values = kv_cache[1][blocks].reshape(shape)[:seq_len]
    return keys, values


class TorchPagedAttention(AttentionBackend):
    """Reference paged attention: one SDPA call per sequence."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        start = 0
        for i, (query_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            end = start + query_len
            keys, values = gather_context(kv_cache, meta.block_tables[i], seq_len, meta.block_size)
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # an FP8 cache widens here
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            mask = self._mask(query_len, seq_len, q.device)
            queries, keys, values = (x.transpose(0, 1) for x in (q[start:end], keys, values))
            if sinks is None:
                attn = sdpa(queries, keys, values, mask, self.scale)
            else:
                attn = attend_with_sinks(queries, keys, values, mask, self.scale, sinks)
            out[start:end] = attn.transpose(0, 1)
            start = end
        return out

    def _mask(self, query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
        q_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= q_pos - k_pos < self.sliding_window
        return mask


def sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA of q [H, n, D] over keys, values [H, L, D] where `mask` ([n, L] bool; or
    `is_causal`) allows.

    NOTE: called with a batch dimension of 1: on the CPU, 3-D inputs take SDPA's math path
    (the whole [H, n, L] score matrix, several passes), 4-D ones its fused kernel: a
    192-token extend over a 4.6k-token cached prefix took 21 ms a layer against 3.7 (the
    tiny model's later-turn prefill, bench/prefix_reuse.py `turns`); results agree to float
    rounding."""
    out = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, is_causal=is_causal, scale=scale
    )
    return out[0]


def attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """q: [H, n, D] over keys, values: [H, L, D] where `mask` ([n, L] bool) allows, with one sink
    logit per head (`sinks` [H], cast to the logits' dtype as HF's are the model's): HF's eager
    gpt-oss attention, operation for operation. Returns [H, n, D]."""
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).reshape(-1, 1, 1).expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
