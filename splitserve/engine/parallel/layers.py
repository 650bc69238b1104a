"""The vocab-parallel embedding: each rank holds a slice of the vocabulary's rows.

Its parameter is named `weight` like `nn.Embedding`'s, so checkpoint names and a tied LM head
(`lm_head.weight = embed_tokens.weight`, the same rows on the same rank) work unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.parallel.group import ParallelGroup
from splitserve.engine.parallel.sharding import vocab_range


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; ids elsewhere look up zeros, and one all-reduce sums
    the ranks' rows (exactly one rank contributes each id)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup) -> None:
        super().__init__()
        self.start, self.end = vocab_range(vocab_size, group.shard)
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)
