"""The attention-backend interface and the per-step metadata every backend reads.

A backend owns two things for one layer: writing this step's keys and values into the paged KV
cache (by `slot_mapping`) and attending each query token to its sequence's cached context (by
`block_tables`). The model never touches pages itself, so a Triton backend plugs in here
without the model changing.

Backends are shared by every layer, so what differs by layer comes with each call: gpt-oss's
attention sinks (`sinks`, one learned logit per query head that joins each softmax's
denominator and has no value, as HF's eager attention concatenates it to the logits and drops
its column after the softmax).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from splitserve.engine.ops import TorchOps

if TYPE_CHECKING:
    from splitserve.engine.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionMetadata:
    """How this step's flattened tokens map onto sequences and cache slots.

    Tokens of all scheduled sequences are laid end to end. Sequence i owns query tokens
    `cu_seqlens_q[i]:cu_seqlens_q[i+1]`; after this step its context holds `seq_lens[i]` tokens,
    the last `query_lens[i]` of which are the queries (so chunked prefill, prefix hits and decode
    are one case). Its pages are `block_tables[i, :ceil(seq_lens[i] / block_size)]`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot for each new token
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


def window_view(meta: AttentionMetadata, window_map: torch.Tensor) -> AttentionMetadata:
    """`meta` for sliding layers whose KV has a pool of its own (engine/kv_cache.py): slots and
    block tables through the window map, on the device (a padded row's slot -1 stays -1)."""
    bs = meta.block_size
    slots = meta.slot_mapping
    blocks = torch.div(slots, bs, rounding_mode="floor").clamp_min(0)
    mapped = window_map[blocks].to(slots.dtype) * bs + slots.remainder(bs)
    return dataclasses.replace(
        meta,
        slot_mapping=torch.where(slots < 0, slots, mapped),
        block_tables=window_map[meta.block_tables.long()],
    )


class AttentionBackend(ABC):
    """Paged attention for one layer. Subclasses register themselves in `BACKENDS` by name."""

    # Whether a decode step through this backend can be captured in a CUDA graph (nothing in it
    # reads device memory on the host).
    graph_safe: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        *,
        ops: TorchOps | None = None,
    ) -> None:
        self.ops = ops or TorchOps()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    @abstractmethod
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
        """Write k, v into `kv_cache` and return attention output.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; sinks: this layer's
        attention sinks, float32 [num_heads], or None. Returns [num_tokens, num_heads, head_dim].
        """

    def rotate_and_forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotary embedding on q and k at `positions`, then `forward`; a backend may fuse them."""
        q, k = self.ops.rotary(positions, q, k, rotary)
        return self.forward(q, k, v, kv_cache, meta, sinks=sinks)


def _torch_backend() -> type[AttentionBackend]:
    from splitserve.engine.torch_attention import TorchPagedAttention

    return TorchPagedAttention


def _triton_backend() -> type[AttentionBackend]:
    from splitserve.engine.triton_attention import TritonPagedAttention

    return TritonPagedAttention


# name -> loader; imports stay lazy so a backend's dependencies load only when it is chosen.
BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]()
