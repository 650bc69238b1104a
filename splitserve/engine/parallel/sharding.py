"""How a checkpoint is cut across tensor-parallel ranks (Megatron-style), and what one rank holds.

    q_proj / k_proj / v_proj   column-parallel by heads   [heads*dim, hidden] rows of rank r
    o_proj                     row-parallel               [hidden, heads*dim] columns of rank r
    gate_proj / up_proj        column-parallel            [inter, hidden] rows of rank r
    down_proj                  row-parallel               [hidden, inter] columns of rank r
    embed_tokens / lm_head     vocab-parallel             [vocab, hidden] rows of rank r (padded)
    norms                      replicated

GQA: with at least as many KV heads as ranks each rank holds `num_kv_heads / tp` of them; with
fewer, `tp / num_kv_heads` ranks share (replicate) one, the one their query heads attend with:

    4 q heads, 1 kv head, tp=2     rank 0: q 0-1, kv 0      rank 1: q 2-3, kv 0

Nothing here imports torch.distributed; `group.py` moves tensors between ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine.model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """One rank's place in a tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")


SINGLE = Shard()


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError, naming the field, if `cfg` can't be split over `tp` ranks."""
    if tp == 1:
        return
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads ({cfg.num_heads})")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"num_key_value_heads ({kv}) (or tp a multiple of it)")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide {', '.join(problems)} of this model"
        )


def kv_head_range(num_kv_heads: int, shard: Shard) -> tuple[int, int]:
    """The KV heads [start, end) rank `shard.rank` holds (one replicated head when fewer)."""
    if num_kv_heads >= shard.size:
        per = num_kv_heads // shard.size
        return shard.rank * per, (shard.rank + 1) * per
    head = shard.rank * num_kv_heads // shard.size
    return head, head + 1


def vocab_range(vocab_size: int, shard: Shard) -> tuple[int, int]:
    """Rows [start, end) of the embedding and LM head on this rank: ceil(vocab / tp) each, the
    last rank's padded past the vocabulary (its pad rows are zero and cut from the logits)."""
    per = -(-vocab_size // shard.size)
    return shard.rank * per, (shard.rank + 1) * per


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The shapes one rank's layers and KV cache have: its heads and MLP columns. The
    vocabulary stays whole (the vocab-parallel layers cut it themselves)."""
    if shard.size == 1:
        return cfg
    check_divisible(cfg, shard.size)
    kv_start, kv_end = kv_head_range(cfg.num_kv_heads, shard)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // shard.size,
        num_kv_heads=kv_end - kv_start,
        intermediate_size=cfg.intermediate_size // shard.size,
    )


def _rows(name: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int] | None:
    """Output rows (dim 0) this rank keeps of a column-parallel tensor, or None."""
    d = cfg.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        per = cfg.num_heads // shard.size * d
        return shard.rank * per, (shard.rank + 1) * per
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        start, end = kv_head_range(cfg.num_kv_heads, shard)
        return start * d, end * d
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        per = cfg.intermediate_size // shard.size
        return shard.rank * per, (shard.rank + 1) * per
    return None


def _cols(name: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int] | None:
    """Input columns (dim 1) this rank keeps of a row-parallel tensor, or None."""
    if name.endswith("o_proj.weight"):
        per = cfg.num_heads // shard.size * cfg.head_dim
        return shard.rank * per, (shard.rank + 1) * per
    if name.endswith("down_proj.weight"):
        per = cfg.intermediate_size // shard.size
        return shard.rank * per, (shard.rank + 1) * per
    return None


def read_slice(name: str, source: Any, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`, read from a safetensors slice `source`
    (only those bytes are read). `cfg` is the whole model's config."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, end = vocab_range(cfg.vocab_size, shard)
        part = source[start : min(end, cfg.vocab_size)]
        if part.shape[0] < end - start:  # the last rank's pad rows
            pad = part.new_zeros((end - start - part.shape[0], *part.shape[1:]))
            part = torch.cat([part, pad])
        return part
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        raise ValueError(f"{name}: a row-parallel bias is not supported with tensor parallelism")
    rows = _rows(name, cfg, shard)
    if rows is not None:
        return source[rows[0] : rows[1]]
    cols = _cols(name, cfg, shard)
    if cols is not None:
        return source[:, cols[0] : cols[1]]
    return source[:]
