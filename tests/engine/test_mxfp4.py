"""MXFP4 dequantization (gpt-oss expert weights) gives exactly what transformers' own gives, in
its layout, for random blocks and scales: small shapes, the gpt-oss-20b projections' trailing
dims, every E8M0 exponent (overflow to inf, and NaN where scale 255 meets a zero)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from splitserve.engine import mxfp4
from splitserve.engine.mxfp4 import dequantize_mxfp4


def _random_mxfp4(
    shape: tuple[int, ...], seed: int, scale_range: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    scales = torch.randint(*scale_range, shape[:-1], generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1, 16),
        (2, 6, 3, 16),
        (3, 5, 2, 4),  # groups of 8 values: nothing assumes 32
        (2, 64, 90, 16),  # gpt-oss-20b's trailing dims (hidden = intermediate = 2880 = 90 * 32)
        (2, 3, 4, 5, 16),  # a dim between experts and rows stays where transformers puts it
    ],
)
def test_dequantize_is_transformers_bit_for_bit(shape, dtype):
    # Weights' real exponents sit near the bias; the full byte range checks the extremes too.
    for seed, scale_range in enumerate([(110, 135), (0, 256)]):
        blocks, scales = _random_mxfp4(shape, seed, scale_range)
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize(
    ("name", "experts", "rows", "groups", "dense"),
    [
        # gpt-oss-20b: hidden 2880, intermediate 2880; 32 experts in the real checkpoint.
        ("gate_up_proj", 1, 2 * 2880, 2880 // 32, (1, 2880, 2 * 2880)),
        ("down_proj", 2, 2880, 2880 // 32, (2, 2880, 2880)),
    ],
)
def test_gpt_oss_20b_projections_take_transformers_parameter_shapes(
    name, experts, rows, groups, dense
):
    """gate_up_proj [E, hidden, 2 * intermediate], down_proj [E, intermediate, hidden]: the
    shapes of HF's GptOssExperts parameters, with its values."""
    blocks, scales = _random_mxfp4(
        (experts, rows, groups, 16), seed=len(name), scale_range=(115, 130)
    )
    got = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert tuple(got.shape) == dense
    assert torch.equal(got, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


def test_one_value_by_hand():
    # Byte 0x7A: low nibble 0xA = -1.0 (first), high nibble 0x7 = 6.0 (second); scale 2^(129-127).
    blocks = torch.full((1, 1, 1, 1), 0x7A, dtype=torch.uint8)
    scales = torch.full((1, 1, 1), 129, dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.flatten().tolist() == [-4.0, 24.0]


def test_mismatched_or_wrongly_typed_inputs_raise():
    blocks, scales = _random_mxfp4((2, 4, 3, 16), seed=0, scale_range=(120, 130))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[:, :, :2])
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks[0], scales[0])
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), scales)


def test_chunked_dequantization_is_the_same(monkeypatch):
    blocks, scales = _random_mxfp4((3, 10, 4, 16), seed=9, scale_range=(100, 150))
    whole = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    monkeypatch.setattr(mxfp4, "ROWS_PER_CHUNK", 7)  # 120 rows: 17 full chunks and a tail
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), whole)


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_weights_and_decodes_as_hf(tmp_path):
    """A gpt-oss checkpoint whose experts are stored as MXFP4 (blocks + scales, the
    quantization_config of the real ones) serves the tokens HF gives on the same weights
    dequantized by transformers."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from splitserve.engine import LLM, SamplingParams
    from splitserve.testing.tiny_families import make_tiny_family_model
    from tests.engine.hf_oracle import hf_greedy, random_prompts

    dense_dir = make_tiny_family_model(
        tmp_path / "dense", "gpt_oss", config_overrides={"intermediate_size": 64}
    )
    packed_dir = tmp_path / "packed"
    packed_dir.mkdir()
    tensors = load_file(dense_dir / "model.safetensors")
    packed = dict(tensors)
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, cols = tensors[name].shape  # stored x @ W: [E, in, out]
        blocks = torch.randint(0, 256, (experts, cols, rows_in // 32, 16), generator=gen)
        scales = torch.randint(120, 126, (experts, cols, rows_in // 32), generator=gen)
        blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file(tensors, dense_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(packed, packed_dir / "model.safetensors", metadata={"format": "pt"})
    for file in dense_dir.iterdir():
        if file.name != "model.safetensors":
            (packed_dir / file.name).write_bytes(file.read_bytes())
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed_dir / "config.json").write_text(json.dumps(config))

    llm = LLM(packed_dir)
    prompts = random_prompts([6, 40], llm.engine.model_config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(dense_dir, tuple(prompt), 16)
