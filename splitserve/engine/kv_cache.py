"""The paged KV cache: one block-major tensor, sized from a memory budget.

A block holds the keys and values of `block_size` tokens in every layer, contiguously, so that
moving a block between workers is one descriptor (one copy) however many layers the model has:

    pool   [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
            └ block b ┘ = one run of `block_bytes` bytes
    layer l view  pool[:, l].transpose(0, 1)  ->  [2, num_blocks, block_size, heads, dim]
            (strided: consecutive blocks are `num_layers` layers apart)

The attention backends see the per-layer views and find each page through its block stride;
transports see the pool and move whole blocks.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.model_config import ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of `block_size` tokens across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def size_kv_pool(model: ModelConfig, config: EngineConfig, budget: int) -> EngineConfig:
    """Return `config` with `num_kv_blocks` set from `budget` bytes (unless it is given)."""
    if config.num_kv_blocks is not None:
        return config
    per_block = bytes_per_block(model, config.block_size, config.cache_dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: budget {budget} bytes, one block needs {per_block}"
        )
    return dataclasses.replace(config, num_kv_blocks=int(num_blocks))


def fit_context_to_pool(config: EngineConfig) -> EngineConfig:
    """`config` serving at most what its sized pool holds of one sequence, when it asks for
    that (`fit_max_model_len_to_pool`, the context not set by the user) and holds fewer tokens
    than its `max_model_len`; one line says so."""
    assert config.num_kv_blocks is not None and config.max_model_len is not None
    holds = config.num_kv_blocks * config.block_size
    if not config.fit_max_model_len_to_pool or holds >= config.max_model_len:
        return config
    print(
        f"serving a context of {holds} tokens, what the KV pool holds ({config.num_kv_blocks}"
        f" blocks), not the model's {config.max_model_len}: give the cache more memory "
        "(--kv-cache-memory-bytes, --gpu-memory-utilization) to serve longer",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(config, max_model_len=holds)


@dataclass(frozen=True)
class KVCache:
    """The pool tensor and the per-layer views the model attends over."""

    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layers: tuple[torch.Tensor, ...]  # per layer: [2, num_blocks, block_size, heads, dim]

    @classmethod
    def allocate(cls, model: ModelConfig, config: EngineConfig) -> KVCache:
        assert config.num_kv_blocks is not None, "size the pool first"
        shape = (
            config.num_kv_blocks,
            model.num_layers,
            2,
            config.block_size,
            model.num_kv_heads,
            model.head_dim,
        )
        pool = torch.zeros(shape, dtype=config.cache_dtype, device=config.device)
        return cls.over(pool)

    @classmethod
    def over(cls, pool: torch.Tensor) -> KVCache:
        """Views of an existing block-major pool."""
        if pool.dim() != 6 or pool.shape[2] != 2 or not pool.is_contiguous():
            raise ValueError(
                "a KV pool is a contiguous [blocks, layers, 2, block_size, heads, dim] tensor, "
                f"got shape {tuple(pool.shape)}"
            )
        layers = tuple(pool[:, layer].transpose(0, 1) for layer in range(pool.shape[1]))
        return cls(pool, layers)

    @property
    def num_blocks(self) -> int:
        return int(self.pool.shape[0])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (every layer's keys and values): one contiguous run."""
        return int(self.pool[0].numel() * self.pool.element_size())

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole blocks src -> dst (copy-on-write of a shared last block)."""
        if not copies:
            return
        device = self.pool.device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        self.pool[dst] = self.pool[src]
