"""The batched LoRA kernels match their torch reference: decode (one row per segment, and rows
grouped by adapter through a row list, as the engine and its CUDA graphs describe them) and
prefill shapes, mixed slots with skipped rows, merged (sliced) projections, and views of one
slot-major buffer as the engine lays its adapters out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.engine.lora.batch import group_rows
from splitserve.kernels.lora import lora_expand, lora_shrink
from splitserve.kernels.lora_ref import lora_expand_ref, lora_shrink_ref


def _segments(spec: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(zip(*spec, strict=True)), dtype=torch.int32, device=device)


def _run(shrink, expand, x, a, b, scales, segs, max_len, y, slices, rows=None):
    out = y.clone()
    s = shrink(x, a, segs, max_len, rows)
    expand(out, s, b, scales, segs, max_len, slices, rows)
    return out


def _case(device, dtype, *, T, K, R, slices, spec, slots=4, max_len=1, gen_seed=0, rows=None):
    gen = torch.Generator().manual_seed(gen_seed)
    N = sum(slices)
    x = torch.randn(T, K, generator=gen).to(device, dtype)
    # One slot-major buffer holding A then B, as the engine's adapter slots do: strided views.
    ra = R * len(slices)
    flat = torch.randn(slots, ra * K + N * R + 7, generator=gen).to(device, dtype) / K**0.5
    a = flat[:, : ra * K].unflatten(1, (ra, K))
    b = flat[:, ra * K : ra * K + N * R].unflatten(1, (N, R))
    scales = torch.rand(slots, generator=gen).to(device) + 0.5
    y = torch.randn(T, N, generator=gen).to(device, dtype)
    segs = _segments(spec, device)
    order = None if rows is None else torch.tensor(rows, dtype=torch.int32, device=device)
    got = _run(lora_shrink, lora_expand, x, a, b, scales, segs, max_len, y, slices, order)
    want = _run(lora_shrink_ref, lora_expand_ref, x, a, b, scales, segs, max_len, y, slices, order)
    covered = torch.zeros(T, dtype=torch.bool)
    for start, n, slot in spec:
        if slot >= 0:
            covered[(rows or list(range(T)))[start : start + n]] = True
    # Rows in no segment (base rows, skipped slots) are never touched.
    assert torch.equal(got[~covered.to(device)], y[~covered.to(device)])
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("slices", [(48,), (32, 16, 16), (40, 24)])
def test_decode_rows_each_gather_their_own_adapter(device, slices):
    # Rows 0..5: slots 2, base (no segment), 0, skipped (-1), 2, 3.
    spec = [(0, 1, 2), (2, 1, 0), (3, 1, -1), (4, 1, 2), (5, 1, 3)]
    _case(device, torch.float32, T=6, K=96, R=8, slices=slices, spec=spec)


def _grouped(row_slots: list[int], tile: int | None) -> tuple[list, list[int], int]:
    segments, rows = group_rows(np.array(row_slots), tile)
    spec = [tuple(int(v) for v in col) for col in segments.T]
    return spec, rows.tolist(), max((n for _, n, _ in spec), default=1)


@pytest.mark.parametrize("slices", [(48,), (32, 16, 16), (40, 24)])
@pytest.mark.parametrize("tile", [None, 16])
def test_decode_rows_grouped_by_adapter_match_reference(device, slices, tile):
    # 40 decode rows: slot 1 on 19 rows (two tiles of 16 and 3 when cut), slot 3 on 7, slot 0
    # on 1, base rows (-1) between them: each adapter's rows read its weights as one tile.
    row_slots = [[1, 3, -1, 1, 0][i % 5] if i % 7 else 1 for i in range(40)]
    spec, rows, max_len = _grouped(row_slots, tile)
    assert len(spec) == (4 if tile else 3)
    _case(device, torch.float32, T=40, K=96, R=8, slices=slices, spec=spec, max_len=max_len,
          rows=rows)  # fmt: skip


def test_split_k_partial_sums_add_up(device):
    # K long enough to split the shrink: 3 partial sums in decode tiles (fewer than a block of
    # them), 4 in prefill tiles (two blocks of 2).
    spec, rows, max_len = _grouped([0, 2, -1, 2, 0, 0], 16)
    _case(device, torch.float32, T=6, K=2560, R=8, slices=(16, 16), spec=spec, max_len=max_len,
          rows=rows)  # fmt: skip
    _case(device, torch.float32, T=40, K=1024, R=8, slices=(24,), spec=[(0, 40, 1)], max_len=40)


def test_graph_capacity_with_skipped_segments_matches_reference(device):
    # A CUDA graph's fixed segment capacity: the step's tiles, then unused ones (slot -1).
    spec, rows, _ = _grouped([2, 0, 2, -1, 2, 0], 16)
    spec += [(0, 0, -1)] * 3
    _case(device, torch.float32, T=6, K=64, R=16, slices=(32, 16, 16), spec=spec, max_len=16,
          rows=rows + [0, 0, 0])  # fmt: skip


@pytest.mark.parametrize("slices", [(64,), (32, 16, 16)])
def test_prefill_segments_match_reference(device, slices):
    # Three prompts (37, 5 and 40 rows) on two adapters, a base prompt between them.
    spec = [(0, 37, 1), (45, 5, 0), (50, 40, 1)]
    _case(device, torch.float32, T=90, K=80, R=16, slices=slices, spec=spec, max_len=40)


def test_prefill_with_rank_below_a_tile(device):
    _case(device, torch.float32, T=20, K=64, R=4, slices=(24, 8, 8), spec=[(2, 18, 3)], max_len=18)


def test_no_segments_leaves_output_alone(device):
    _case(device, torch.float32, T=4, K=32, R=8, slices=(16,), spec=[(0, 4, -1)], max_len=4)


def test_prefill_prompts_grouped_by_adapter_match_reference(device):
    # Prompts of 37, 5, 8 and 40 rows on adapters 1, 0, base, 1: adapter 1's two prompts form
    # one 77-row segment, read through the row list.
    row_slots = [1] * 37 + [0] * 5 + [-1] * 8 + [1] * 40
    spec, rows, max_len = _grouped(row_slots, None)
    assert spec == [(0, 5, 0), (5, 77, 1)]
    _case(device, torch.float32, T=90, K=80, R=16, slices=(40, 24), spec=spec, max_len=max_len,
          rows=rows)  # fmt: skip


def test_group_rows_cuts_groups_into_tiles_in_row_order():
    segments, rows = group_rows(np.array([2, -1, 0, 2, 2, 0, -1, 2]), tile=3)
    assert rows.tolist() == [2, 5, 0, 3, 4, 7]
    assert segments.tolist() == [[0, 2, 5], [2, 3, 1], [0, 2, 2]]
    segments, rows = group_rows(np.array([-1, -1]), tile=3)
    assert segments.shape == (3, 0) and rows.size == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-bit tl.dot needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_on_gpu(device, dtype):
    spec = [(0, 1, 1), (1, 1, 0), (3, 1, 1)]
    _case(device, dtype, T=4, K=4096, R=16, slices=(4096, 1024, 1024), spec=spec)
    row_slots = [i % 3 - 1 for i in range(64)]  # the decode graphs' tiles of a batch of 64
    spec, rows, _ = _grouped(row_slots, 16)
    _case(device, dtype, T=64, K=4096, R=16, slices=(4096, 1024, 1024), spec=spec, max_len=16,
          rows=rows)  # fmt: skip
    spec = [(0, 300, 1), (300, 211, 0)]
    _case(device, dtype, T=600, K=512, R=16, slices=(256, 256), spec=spec, max_len=300)


def test_shape_mismatch_is_a_clear_error(device):
    x = torch.zeros(2, 8, device=device)
    a = torch.zeros(2, 4, 9, device=device)
    with pytest.raises(ValueError, match="does not fit"):
        lora_shrink(x, a, _segments([(0, 1, 0)], device), 1)


def test_lora_layer_runs_the_kernels_on_the_engines_batch(device):
    # What a layer's hook does in an eager step: the batch `LoRABatch.build` groups (a prompt
    # and decode rows on two adapters, a base row), through the kernels and the reference.
    from splitserve.engine.lora.batch import LoRAContext, LoRALayer

    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(3, 16, 64, generator=gen) / 8).to(device)
    b = (torch.randn(3, 48, 8, generator=gen) / 4).to(device)
    context = LoRAContext(torch.tensor([0.5, 1.0, 2.0], device=device))
    views = {"gate_up": (a, b, (24, 24))}
    x = torch.randn(9, 64, generator=gen).to(device)
    y = torch.randn(9, 48, generator=gen).to(device)
    outs = []
    for triton in (True, False):
        context.describe([5, 1, 1, 1, 1], [2, 0, None, 2, 0])
        outs.append(LoRALayer(context, views, triton).apply("gate_up", x, y.clone()))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[0][6], y[6]) and not torch.equal(outs[0][:6], y[:6])
