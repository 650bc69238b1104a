"""Absorbed MLA decode (kernels/mla_decode.py) matches its torch reference and the decompressed
attention (per-head keys and values from kv_b_proj, SDPA): sequences crossing block edges,
padding rows, heads that fill no whole block of 16, one and many splits, a latent width that is
not a power of two; and MLAttention's decode-only step gives the same output absorbed as
decompressed, also after its weights are reloaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.mla import MLAttention, attention, causal_mask, gather_latents
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops import TorchOps, TritonOps
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.kernels.mla_decode import LaunchConfig, mla_decode, mla_decode_ref
from tests.kernels.paged_inputs import DTYPES, random_paged_kv, tolerance

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (seq_lens, num_heads, kv_lora_rank, rope_dim, block_size, num_splits)
CPU_CASES = [
    ([1, 17, 40], 4, 32, 8, 16, 1),  # the tiny models' latent, one split writes the output
    ([1, 17, 40], 4, 32, 8, 16, 3),  # ... split, merged
    ([0, 45, 0, 7], 5, 32, 8, 16, 2),  # seq_len 0 padding rows
    ([130, 3], 20, 24, 8, 8, 4),  # two head blocks, a rank padded to 32; short row: empty splits
    ([96, 64, 250, 0], 4, 32, 16, 16, None),  # the split heuristic picks
]


def _inputs(seq_lens, heads, rank, rope, block_size, dtype, device, seed):
    paged = random_paged_kv(seq_lens, 1, rank + rope, block_size, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen).to(device, dtype)
    # The layer's latent cache: one plane of a three-layer pool (NaN outside every context).
    return q, paged.kv_cache[:1], paged.block_tables, paged.seq_lens


def decompressed(q_nope, q_pe, w_uk, w_uv, cache, tables, seq_lens, scale):
    """The attention before absorption: per-head keys [c @ W_UK^T | k_pe] and values c @ W_UV^T
    of every cached latent, then SDPA, all in float32."""
    rank = w_uk.shape[-1]
    out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=torch.float32)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        rows = gather_latents(cache, tables[i], seq_len, cache.shape[2]).float()
        c, k_pe = rows[:, :rank], rows[:, rank:]
        keys = torch.cat(
            [torch.einsum("sr,hnr->hsn", c, w_uk), k_pe.expand(w_uk.shape[0], -1, -1)], dim=-1
        )
        values = torch.einsum("sr,hvr->hsv", c, w_uv)
        q = torch.cat([q_nope[i], q_pe[i]], dim=-1).float()[:, None]  # [H, 1, D]
        out[i] = F.scaled_dot_product_attention(q, keys, values, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(len(CPU_CASES)))
def test_kernel_matches_reference_and_decompressed_attention(index, dtype, device):
    seq_lens, heads, rank, rope, block_size, splits = CPU_CASES[index]
    q, cache, tables, lens = _inputs(seq_lens, heads, rank, rope, block_size, dtype, device, index)
    scale = 0.2
    out = torch.full((len(seq_lens), heads, rank), float("nan"), dtype=dtype, device=device)
    got = mla_decode(q, cache, tables, lens, rank, scale, out=out, num_splits=splits)
    assert got is out
    want = mla_decode_ref(q, cache, tables, lens, rank, scale)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert all(torch.all(got[i] == 0) for i, n in enumerate(seq_lens) if n == 0)
    if dtype != torch.float32:
        return
    # Against the decompressed attention: q = [q_nope @ W_UK | q_pe], out = latent @ W_UV^T.
    gen = torch.Generator().manual_seed(index + 2)
    nope, v_dim = 16, 24
    w_uk = (torch.randn(heads, nope, rank, generator=gen) * rank**-0.5).to(device)
    w_uv = (torch.randn(heads, v_dim, rank, generator=gen) * rank**-0.5).to(device)
    q_nope = torch.randn(len(seq_lens), heads, nope, generator=gen).to(device)
    q_pe = q[..., rank:]
    q_abs = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe], dim=-1).contiguous()
    latent = mla_decode(q_abs, cache, tables, lens, rank, scale, num_splits=splits)
    absorbed = torch.einsum("bhr,hvr->bhv", latent, w_uv)
    want = decompressed(q_nope, q_pe, w_uk, w_uv, cache, tables, lens, scale)
    torch.testing.assert_close(absorbed, want, atol=1e-5, rtol=1e-5)


# The transposed kernel (context rows on the dots' M side), at tile sizes the sweep tries.
TRANSPOSED = [LaunchConfig(16, 4, 1, True), LaunchConfig(32, 4, 2, True)]


@pytest.mark.parametrize("launch", TRANSPOSED)
@pytest.mark.parametrize("index", [1, 2, 3])
def test_transposed_kernel_matches_reference(index, launch, device):
    seq_lens, heads, rank, rope, block_size, splits = CPU_CASES[index]
    dtype = torch.float32
    q, cache, tables, lens = _inputs(seq_lens, heads, rank, rope, block_size, dtype, device, index)
    out = torch.full((len(seq_lens), heads, rank), float("nan"), dtype=dtype, device=device)
    got = mla_decode(q, cache, tables, lens, rank, 0.2, out=out, num_splits=splits, launch=launch)
    want = mla_decode_ref(q, cache, tables, lens, rank, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.all(got[i] == 0) for i, n in enumerate(seq_lens) if n == 0)


def test_each_split_count_gives_the_same_output(device):
    q, cache, tables, lens = _inputs([150, 77], 4, 32, 8, 16, torch.float32, device, seed=5)
    one = mla_decode(q, cache, tables, lens, 32, 0.3, num_splits=1)
    for splits in (2, 5):
        torch.testing.assert_close(
            mla_decode(q, cache, tables, lens, 32, 0.3, num_splits=splits), one
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].double()}, "q must have dtype"),
        (lambda a: {**a, "kv_cache": a["kv_cache"].half()}, "kv_cache must have dtype"),
        (lambda a: {**a, "kv_lora_rank": 40}, "do not fit"),
        (lambda a: {**a, "block_tables": a["block_tables"].long()}, "block_tables must have"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens must have shape"),
        (lambda a: {**a, "kv_cache": a["kv_cache"].expand(2, -1, -1, -1, -1)}, "kv_cache must be"),
    ],
)
def test_bad_arguments_raise_before_launch(change, message, device):
    q, cache, tables, lens = _inputs([5, 9], 4, 32, 8, 16, torch.float32, device, seed=0)
    args = {"q": q, "kv_cache": cache, "block_tables": tables, "seq_lens": lens,
            "kv_lora_rank": 32, "scale": 0.25}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        mla_decode(**change(args))


def _tiny_attention(device: torch.device, ops: TorchOps) -> MLAttention:
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
        "rope_theta": 10000,
    })  # fmt: skip
    assert cfg.mla is not None
    torch.manual_seed(0)
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, 512)
    attn = MLAttention(cfg, rotary, ops).to(device)
    rotary.reset(device)
    return attn


# The Triton ops take the fused path: the normed latent write, then the absorbed query built in
# place (strided bmm, kernels/mla_query.py) and the output without a transpose.
@pytest.mark.parametrize("ops", [TorchOps(), TritonOps(pdl=False)], ids=["torch", "triton"])
def test_decode_step_absorbed_equals_decompressed_and_follows_reloads(device, ops):
    attn = _tiny_attention(device, ops)
    seq_lens = [1, 17, 40, 33]
    block = 16
    paged = random_paged_kv(seq_lens, 1, 40, block, torch.float32, device, seed=3)
    cache, tables = paged.kv_cache[:1], paged.block_tables
    positions = torch.tensor([n - 1 for n in seq_lens], device=device)
    slots = torch.stack(
        [tables[i, p // block] * block + p % block for i, p in enumerate(positions)]
    )
    meta = AttentionMetadata(
        slot_mapping=slots.long(),
        cu_seqlens_q=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device),
        seq_lens=paged.seq_lens,
        block_tables=tables,
        query_lens_cpu=(1,) * len(seq_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block,
    )
    x = torch.randn(len(seq_lens), 64, device=device)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        outs = []
        for absorb in (True, False):
            attn.absorb_decode = absorb
            outs.append(attn(positions, x, cache, meta))
        return outs[0], outs[1]

    with torch.no_grad():
        absorbed, plain = both()
        torch.testing.assert_close(absorbed, plain, atol=1e-5, rtol=1e-5)
        attn.kv_b_proj.weight.mul_(-0.5)  # reloaded in place
        absorbed, plain = both()
        torch.testing.assert_close(absorbed, plain, atol=1e-5, rtol=1e-5)
        attn.kv_b_proj.weight = nn.Parameter(torch.randn_like(attn.kv_b_proj.weight) * 0.2)
        absorbed, plain = both()
        torch.testing.assert_close(absorbed, plain, atol=1e-5, rtol=1e-5)
        w_uk, w_uv = attn.absorbed_weights()
        assert w_uk.data_ptr() == attn.kv_b_proj.weight.data_ptr()
        assert torch.equal(torch.cat([w_uk, w_uv], dim=1).flatten(0, 1), attn.kv_b_proj.weight)


@needs_gpu
@pytest.mark.parametrize("launch", [None, LaunchConfig(64, 8, 2, True)])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_deepseek_v2_lite_shape_on_gpu(num_splits, launch):
    """DeepSeek-V2-Lite's attention (16 heads, latent 512 + 64) in bf16 over 4k contexts, each
    kernel."""
    cuda = torch.device("cuda")
    seq_lens = [4096, 1, 3000, 0, 4095, 17]
    q, cache, tables, lens = _inputs(seq_lens, 16, 512, 64, 16, torch.bfloat16, cuda, seed=9)
    scale = 192**-0.5
    got = mla_decode(q, cache, tables, lens, 512, scale, num_splits=num_splits, launch=launch)
    want = mla_decode_ref(q, cache, tables, lens, 512, scale)
    atol, rtol = tolerance(torch.bfloat16)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.slow
def test_benchmark_smoke_run_writes_json(tmp_path):
    import json

    from bench.mla_decode import main

    out = tmp_path / "mla_decode.json"
    main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = [r for r in result["rows"] if "skipped" not in r]
    assert rows and all(r["GB_per_s"] > 0 and r["num_splits"] >= 1 for r in rows)


@pytest.mark.slow
def test_prefill_benchmark_smoke_run_writes_json(tmp_path):
    """bench/mla_prefill.py times the engine's latent prefill beside per-head attention."""
    import json

    from bench.mla_prefill import main

    out = tmp_path / "mla_prefill.json"
    main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 200]
    assert all(r["latent ms"] > 0 and r["per-head ms"] > 0 for r in rows)


@pytest.mark.parametrize("masked", [False, True])
def test_prefill_attention_with_padded_values_equals_sdpa(masked):
    """`mla.attention` pads DeepSeek's narrower values to the keys' width on a GPU (the flash
    kernel's one head width): the outputs are SDPA's, causal or under a shifted mask."""
    gen = torch.Generator().manual_seed(3)
    heads, q_len, seq_len, qk, v_dim = 3, 5 if masked else 9, 9, 24, 16
    q = torch.randn(heads, q_len, qk, generator=gen)
    k = torch.randn(heads, seq_len, qk, generator=gen)
    v = torch.randn(heads, seq_len, v_dim, generator=gen)
    mask = causal_mask(q_len, seq_len, q.device) if masked else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked, scale=0.3)
    got = attention(q, k, v, mask, not masked, 0.3, pad_values=True)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
