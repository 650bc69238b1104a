"""The fused MoE layer matches its torch reference: every activation, with and without biases,
experts shared by many tokens, experts no token chose, ids of experts this rank does not hold,
decode and prefill tilings, FP8 (e4m3) expert weights with per-channel scales; its alignment
tiles only the experts the batch touches; and the reference itself matches a dense per-token loop
and HF transformers' expert blocks, and with FP8 weights the same layer on the dequantized ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.quantization import quantize_weight
from splitserve.kernels.fused_moe import fused_moe, moe_align, num_tiles_bound, pick_config
from splitserve.kernels.moe_ref import ACTIVATIONS, GemmTiles, MoeConfig, fused_moe_ref
from tests.kernels.paged_inputs import DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layer(T, k, E, H, I, device, dtype=torch.float32, bias=False, ids=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    if ids is None:  # k distinct experts per token, as a router picks them
        ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k]
    weights = torch.rand(T, k, generator=gen)
    b13 = torch.randn(E, 2 * I, generator=gen) if bias else None
    b2 = torch.randn(E, H, generator=gen) if bias else None
    move = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
    return {
        "x": move(x), "w13": move(w13), "w2": move(w2), "topk_ids": ids.contiguous().to(device),
        "topk_weights": weights.to(device), "w13_bias": move(b13), "w2_bias": move(b2),
    }  # fmt: skip


def _fp8(layer, names=("w13", "w2")):
    """The layer with `names` quantized per expert and output channel (e4m3 + float32 scale)."""
    layer = dict(layer)
    for name in names:
        w = layer[name]
        q, scale = quantize_weight(w.flatten(0, 1))
        layer[name], layer[f"{name}_scale"] = q.view(w.shape), scale.view(w.shape[:2])
    return layer


def _dequantized(layer):
    """An FP8 layer's weights back in float32 (w.float() * scale), no scales."""
    layer = dict(layer)
    for name in ("w13", "w2"):
        if (scale := layer.pop(f"{name}_scale", None)) is not None:
            layer[name] = layer[name].float() * scale[..., None]
    return layer


def _float32(t):
    """A 16-bit tensor in float32; anything else (FP8 weights, ids, names) as it is."""
    is16 = isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)
    return t.float() if is16 else t


def _check(layer, activation="silu", config=None, tol=2e-5):
    args = [layer[n] for n in ("x", "w13", "w2", "topk_ids", "topk_weights")]
    kw = {"activation": activation, "w13_bias": layer["w13_bias"], "w2_bias": layer["w2_bias"]}
    kw |= {n: layer[n] for n in ("w13_scale", "w2_scale") if n in layer}
    got = fused_moe(*args, **kw, config=config)
    want = fused_moe_ref(*args, **kw)
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        return got
    # NOTE: in 16 bits the kernel (float32 accumulation, the intermediate rounded once) and the
    # reference (HF's order: each projection rounded) round at different points, so a value summed
    # from large terms may differ by a few units in its last place: the kernel must be as close to
    # the float32 result as the reference is.
    exact = fused_moe_ref(*map(_float32, args), **{n: _float32(v) for n, v in kw.items()})
    err, ref_err = (got.float() - exact).abs().max(), (want.float() - exact).abs().max()
    assert err <= 2 * ref_err + tol * exact.abs().max(), (err, ref_err)
    return got


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("T", "k", "E", "H", "I"), [(1, 1, 4, 32, 16), (3, 2, 8, 64, 48),
                                                     (17, 2, 6, 64, 48)])  # fmt: skip
def test_fused_moe_matches_reference(T, k, E, H, I, activation, bias, device):
    _check(_layer(T, k, E, H, I, device, bias=bias, seed=T + E), activation)


def test_shared_and_untouched_experts(device):
    # Expert 1 on every token (17 rows: two 16-row tiles), expert 3 on some, 0 and 2 on none.
    ids = torch.tensor([[1, 3] if t % 3 else [3, 1] for t in range(17)])
    _check(_layer(17, 2, 4, 32, 48, device, bias=True, ids=ids), "swiglu_oai")
    # One token choosing the same expert twice adds its output twice.
    _check(_layer(2, 2, 4, 32, 16, device, ids=torch.tensor([[2, 2], [0, 2]])))


def test_ids_outside_the_layer_add_nothing(device):
    # -1 and E: experts this rank does not hold (expert parallelism).
    ids = torch.tensor([[0, -1], [4, 4], [2, 0]])
    layer = _layer(3, 2, 4, 32, 16, device, ids=ids)
    out = _check(layer)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_many_pairs_count_experts_first_and_stay_deterministic(device):
    # 600 pairs: past the one-pass alignment, a counting kernel runs first.
    layer = _layer(300, 2, 4, 32, 16, device, seed=5)
    first = _check(layer, "gelu_tanh")
    assert torch.equal(first, _check(layer, "gelu_tanh"))


@pytest.mark.parametrize("block_m", [16, 32])
def test_explicit_tiles_with_several_k_steps(block_m, device):
    config = MoeConfig(block_m, GemmTiles(16, 16), GemmTiles(32, 16))
    _check(_layer(40, 2, 5, 64, 48, device, bias=True, seed=2), "silu", config)


def test_strided_rows_and_half_precision(device):
    layer = _layer(9, 2, 4, 32, 16, device, dtype=torch.float16, bias=True)
    wide = torch.randn(9, 80, device=device).to(torch.float16)
    wide[:, 8:40] = layer["x"]
    layer["x"] = wide[:, 8:40]  # rows 80 apart
    _check(layer, "silu", tol=2e-2)


# DTYPES: bfloat16 on a GPU only (Triton's interpreter computes it wrongly on the CPU).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize(("T", "k", "E", "H", "I"), [(1, 2, 4, 32, 16), (17, 2, 6, 64, 48)])
def test_fp8_experts_match_reference(T, k, E, H, I, activation, bias, dtype, device):
    layer = _fp8(_layer(T, k, E, H, I, device, dtype=dtype, bias=bias, seed=T + E))
    assert layer["w13"].dtype == layer["w2"].dtype == torch.float8_e4m3fn
    _check(layer, activation, tol=2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("names", [("w13",), ("w2",)])
def test_one_fp8_projection_and_several_k_steps(names, device):
    config = MoeConfig(16, GemmTiles(16, 16), GemmTiles(32, 16))
    _check(_fp8(_layer(40, 2, 5, 64, 48, device, bias=True, seed=2), names), "gelu_tanh", config)


def test_fp8_arguments_are_clear_errors(device):
    layer = _fp8(_layer(2, 2, 4, 32, 16, device))
    args = [layer[n] for n in ("x", "w13", "w2", "topk_ids", "topk_weights")]
    for moe in (fused_moe, fused_moe_ref):
        with pytest.raises(ValueError, match="w13_scale"):
            moe(*args, w2_scale=layer["w2_scale"])  # an FP8 w13 without its scales
        with pytest.raises(ValueError, match="w2_scale"):
            moe(*args, w13_scale=layer["w13_scale"], w2_scale=layer["w2_scale"][:, :8])
    plain = _layer(2, 2, 4, 32, 16, device)
    with pytest.raises(ValueError, match="w13"):  # a scale belongs to an FP8 weight
        fused_moe(*[plain[n] for n in ("x", "w13", "w2", "topk_ids", "topk_weights")],
                  w13_scale=layer["w13_scale"])  # fmt: skip


def test_fp8_reference_is_the_layer_on_dequantized_weights():
    layer = _fp8(_layer(6, 3, 5, 24, 20, "cpu", bias=True, seed=9))
    # float32: bitwise the 16/32-bit path on w.float() * scale.
    want = fused_moe_ref(**_dequantized(layer), activation="silu")
    assert torch.equal(fused_moe_ref(**layer, activation="silu"), want)
    # bf16 activations: each projection exact in float32, rounded to bf16 once.
    half = {**layer, "x": layer["x"].bfloat16()}
    half |= {n: layer[n].bfloat16() for n in ("w13_bias", "w2_bias")}
    dense = _dense_loop(**_dequantized(half), activation="silu")
    got = fused_moe_ref(**half, activation="silu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), dense, atol=3e-2, rtol=3e-2)


def _sorted_by_expert(ids: torch.Tensor, num_experts: int) -> list[int]:
    flat = ids.flatten().tolist()
    return [p for e in range(num_experts) for p, i in enumerate(flat) if i == e]


@pytest.mark.parametrize(("T", "k", "E", "block_m"), [(1, 8, 128, 16), (7, 3, 5, 16),
                                                      (300, 2, 6, 32)])  # fmt: skip
def test_alignment_tiles_only_touched_experts(T, k, E, block_m, device):
    gen = torch.Generator().manual_seed(T)
    ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k].contiguous().to(device, torch.int32)
    sorted_pairs, tiles = moe_align(ids, E, block_m)
    want = _sorted_by_expert(ids.cpu(), E)
    assert sorted_pairs.tolist() == want  # stable: pair order within an expert
    assert tiles.shape == (3, num_tiles_bound(T * k, E, block_m))
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=E).tolist()
    expected = []  # each expert's rows in BLOCK_M tiles, experts in order
    for e, n in enumerate(counts):
        end = sum(counts[: e + 1])
        expected += [(e, r, min(r + block_m, end)) for r in range(end - n, end, block_m)]
    live = [tuple(col) for col in tiles.t().tolist() if col[0] >= 0]
    assert live == expected
    assert (tiles[0, len(expected) :] == -1).all()
    if T == 1:  # decode: k tiles of one row each, no slot for the 120 untouched experts
        assert tiles.shape[1] == k and len(live) == k


def test_decode_config_splits_the_weights_over_every_sm():
    # Qwen3-30B-A3B: H 2048, I 768, E 128, k 8; at least a program per SM of an H100 (132)
    decode = pick_config(1, 8, 128, 2048, 768)
    assert decode.block_m == 16
    gate_up = 8 * 768 // decode.gate_up.block_n
    down = 8 * 2048 // decode.down.block_n
    assert gate_up >= 132 and down >= 132
    prefill = pick_config(4096, 8, 128, 2048, 768)
    assert prefill.block_m >= 64 and prefill.down.block_n >= 128
    with pytest.raises(ValueError, match="powers of two"):
        GemmTiles(24, 64)


def test_bad_arguments_are_clear_errors(device):
    layer = _layer(2, 2, 4, 32, 16, device)
    args = [layer[n] for n in ("x", "w13", "w2", "topk_ids", "topk_weights")]
    with pytest.raises(ValueError, match="activation"):
        fused_moe(*args, activation="relu")
    with pytest.raises(ValueError, match="w2"):
        fused_moe(args[0], args[1], args[2][:, :, :8], *args[3:])
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(args[0], args[1].half(), *args[2:])
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(*args[:4], args[4][:, :1])
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(*args[:3], args[3].t().contiguous().t(), args[4])


def _dense_loop(x, w13, w2, topk_ids, topk_weights, *, activation, w13_bias=None, w2_bias=None):
    """Each token, each of its experts, one at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j, e in enumerate(topk_ids[t].tolist()):
            h = w13[e].double() @ x[t].double()
            if w13_bias is not None:
                h = h + w13_bias[e].double()
            gate, up = h[:inter], h[inter:]
            if activation == "silu":
                act = F.silu(gate) * up
            elif activation == "gelu_tanh":
                act = F.gelu(gate, approximate="tanh") * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y = w2[e].double() @ act
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += topk_weights[t, j].double() * y
    return out


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_equals_a_dense_per_token_loop(activation):
    layer = _layer(6, 3, 5, 24, 20, "cpu", dtype=torch.float64, bias=True, seed=9)
    layer["x"] = layer["x"] * 4  # into swiglu_oai's clamps
    got = fused_moe_ref(**layer, activation=activation)
    torch.testing.assert_close(got, _dense_loop(**layer, activation=activation))


def test_reference_matches_hf_qwen3_moe_and_gpt_oss_experts():
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    layer = _layer(7, 2, 4, 32, 16, "cpu", bias=True, seed=4)
    ids, weights = layer["topk_ids"], layer["topk_weights"]
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4)
    qwen = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        qwen.gate_up_proj.copy_(layer["w13"])
        qwen.down_proj.copy_(layer["w2"])
        want = qwen(layer["x"], ids, weights)
    got = fused_moe_ref(layer["x"], layer["w13"], layer["w2"], ids, weights)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # gpt-oss: [E, H, 2I] with gate and up interleaved, [E, I, H], biases; its own clamps.
    oss = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4))
    w13, b13 = layer["w13"], layer["w13_bias"]
    with torch.no_grad():
        oss.gate_up_proj.copy_(torch.stack([w13[:, :16], w13[:, 16:]], 2).flatten(1, 2).mT)
        oss.gate_up_proj_bias.copy_(torch.stack([b13[:, :16], b13[:, 16:]], 2).flatten(1))
        oss.down_proj.copy_(layer["w2"].mT)
        oss.down_proj_bias.copy_(layer["w2_bias"])
        want = oss(layer["x"] * 4, ids, weights)
    got = fused_moe_ref(**{**layer, "x": layer["x"] * 4}, activation="swiglu_oai")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_bf16_qwen3_moe_shape_on_gpu(T):
    layer = _layer(T, 8, 128, 2048, 768, "cuda", dtype=torch.bfloat16, seed=T)
    _check(layer, "silu", tol=3e-2)


@needs_gpu
@pytest.mark.parametrize("T", [1, 64])
def test_fp8_bf16_qwen3_moe_shape_on_gpu(T):
    layer = _fp8(_layer(T, 8, 128, 2048, 768, "cuda", dtype=torch.bfloat16, seed=T))
    _check(layer, "silu", tol=3e-2)


@needs_gpu
def test_cuda_graph_replays_new_routing():
    layer = _layer(8, 4, 16, 256, 96, "cuda", seed=1)
    args = [layer[n] for n in ("x", "w13", "w2", "topk_ids", "topk_weights")]
    fused_moe(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*args)
    for seed in range(3):
        fresh = _layer(8, 4, 16, 256, 96, "cuda", seed=seed + 10)
        layer["topk_ids"].copy_(fresh["topk_ids"])
        layer["topk_weights"].copy_(fresh["topk_weights"])
        graph.replay()
        torch.testing.assert_close(out, fused_moe_ref(*args), atol=2e-5, rtol=2e-5)
