"""How a step's rows reach the LoRA kernels: grouped by adapter (each adapter's weights read
once per tile of rows), base rows in no segment, and a CUDA graph's fixed segment capacity
enough for any batch of its bucket on at most `max_loras` adapters."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from splitserve.engine.lora.batch import LoRABatch, LoRAContext, group_rows, tile_capacity
from splitserve.kernels.lora_ref import TILE_ROWS


def test_build_groups_each_adapters_rows_across_sequences():
    # A prompt of 3 tokens on slot 1, a base decode row, a decode row on slot 0, a prompt of
    # 2 tokens on slot 1: slot 0's row, then slot 1's five rows in row order.
    batch = LoRABatch.build([3, 1, 1, 2], [1, None, 0, 1], torch.device("cpu"))
    assert batch is not None and batch.rows is not None
    assert batch.segments.tolist() == [[0, 1], [1, 5], [0, 1]]
    assert batch.rows.tolist() == [4, 0, 1, 2, 5, 6]
    assert batch.max_seg_len == 5


def test_a_step_without_adapters_has_no_batch():
    assert LoRABatch.build([4, 1], [None, None], torch.device("cpu")) is None
    assert LoRABatch.build([0, 1], [2, None], torch.device("cpu")) is None


def test_context_builds_the_batch_only_when_a_layer_asks():
    context = LoRAContext(torch.ones(2))
    context.describe([1, 1], [None, 1])
    assert context._batch is None  # a replayed CUDA graph never asks: nothing built
    batch = context.batch
    assert batch is not None and batch.rows is not None and batch.rows.tolist() == [1]
    context.batch = None
    assert context.batch is None


@pytest.mark.parametrize("bucket", [1, 8, 24, 64, 256])
@pytest.mark.parametrize("max_loras", [1, 4, 32])
def test_graph_capacity_holds_any_batch_of_its_bucket(bucket, max_loras):
    rng = random.Random(bucket * 100 + max_loras)
    cap = tile_capacity(bucket, max_loras, TILE_ROWS)
    worst = 0
    for _ in range(200):
        used = rng.sample(range(64), min(max_loras, rng.randint(1, 64)))
        row_slots = [rng.choice([*used, -1]) for _ in range(rng.randint(1, bucket))]
        segments, rows = group_rows(np.array(row_slots), TILE_ROWS)
        assert int(segments[1].max(initial=0)) <= TILE_ROWS
        assert sorted(rows.tolist()) == [i for i, s in enumerate(row_slots) if s >= 0]
        worst = max(worst, segments.shape[1])
    # The bound is reached: every adapter with one row more than a multiple of the tile.
    n = min(max_loras, bucket // (TILE_ROWS + 1)) or 1
    tight = [i % n for i in range(n * (TILE_ROWS + 1))][:bucket]
    worst = max(worst, group_rows(np.array(tight), TILE_ROWS)[0].shape[1])
    assert worst <= cap
