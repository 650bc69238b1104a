"""The fused router top-k matches transformers' order of operations (`moe_route_ref`): the same
experts in the same order and the same weights, for both routers, with and without
renormalisation, any number of experts; ties go to the lower expert id; bad arguments are clear
errors. And the reference is HF's own Qwen3-MoE router."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.moe_ref import moe_route_ref
from splitserve.kernels.moe_route import moe_route
from tests.kernels.paged_inputs import DTYPES


def _distinct_logits(T, E, dtype, device, seed=0):
    """Scores that are all different, and exactly so in 16 bits (multiples of 1/16 in [-4, 4)),
    so that the top k is one answer whichever way a tie would be broken."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(E, generator=gen) for _ in range(T)]
    scale = 8.0 / max(E, 128)
    return (torch.stack(rows).float() * scale - 4.0).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("router", "renormalize"), [("softmax_topk", True),
                                                     ("softmax_topk", False),
                                                     ("topk_softmax", False)])  # fmt: skip
@pytest.mark.parametrize(("T", "E", "k"), [(1, 128, 8), (5, 8, 2), (3, 6, 1), (2, 60, 4)])
def test_route_matches_the_reference(T, E, k, router, renormalize, dtype, device):
    logits = _distinct_logits(T, E, dtype, device)
    weights, ids = moe_route(logits, k, router, renormalize)
    want_weights, want_ids = moe_route_ref(logits, k, router, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype and weights.shape == (T, k)
    assert torch.equal(ids, want_ids)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(weights, want_weights, atol=tol, rtol=tol)
    if renormalize or router == "topk_softmax":
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(T, device=device),
                                   atol=1e-2, rtol=0)  # fmt: skip


def test_equal_scores_go_to_the_lower_expert(device):
    logits = torch.zeros(2, 16, device=device)
    logits[1, 9] = logits[1, 3] = 1.0
    weights, ids = moe_route(logits, 3)
    assert ids.tolist() == [[0, 1, 2], [3, 9, 0]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=device))


def test_strided_rows_and_no_tokens(device):
    wide = _distinct_logits(4, 64, torch.float32, device)
    logits = wide[:, :32]  # rows 64 apart
    weights, ids = moe_route(logits, 4)
    want_weights, want_ids = moe_route_ref(logits, 4)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
    weights, ids = moe_route(logits[:0], 4)
    assert weights.shape == ids.shape == (0, 4)


def test_bad_arguments_are_clear_errors(device):
    logits = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="router"):
        moe_route(logits, 2, "sigmoid")
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 9)
    with pytest.raises(ValueError, match="contiguous"):
        moe_route(logits.t(), 1)


def test_the_reference_is_hfs_qwen3_moe_router():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    hf = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(7, 32)
    logits = torch.nn.functional.linear(x, hf.weight)
    out = hf(x)
    hf_weights, hf_ids = out[-2], out[-1]
    weights, ids = moe_route_ref(logits, 4, "softmax_topk", True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.to(weights.dtype))
