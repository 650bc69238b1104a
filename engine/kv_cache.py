"""The paged KV cache tensors: sizing the pool from a memory budget, allocating, copying blocks."""

from __future__ import annotations

import dataclasses

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
    per_block = bytes_per_block(model, config.block_size, config.dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: budget {budget} bytes, one block needs {per_block}"
        )
    return dataclasses.replace(config, num_kv_blocks=int(num_blocks))


def allocate_kv_cache(model: ModelConfig, config: EngineConfig) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""
    assert config.num_kv_blocks is not None, "size the pool first"
    shape = (2, config.num_kv_blocks, config.block_size, model.num_kv_heads, model.head_dim)
    return [
        torch.zeros(shape, dtype=config.dtype, device=config.device)
        for _ in range(model.num_layers)
    ]


def copy_blocks(kv_caches: list[torch.Tensor], copies: tuple[tuple[int, int], ...]) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write of a shared last block)."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=kv_caches[0].device)
    dst = torch.tensor([d for _, d in copies], device=kv_caches[0].device)
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]
