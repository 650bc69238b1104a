"""YaRN RoPE: the engine's cos/sin tables (and so its rotated q and k) are transformers' own, bit
for bit in float32, for gpt-oss's config (untruncated ramp, attention factor from `factor`) and
DeepSeek-style ones (`mscale` / `mscale_all_dim`, truncated ramp, a factor derived from the two
context lengths), read from `rope_parameters` (transformers 5) or legacy `rope_scaling`; and the
Triton rotary kernel, which reads the same tables, rotates as the engine does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_rotary
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from splitserve.engine.model_config import RopeConfig
from splitserve.engine.rotary import RotaryEmbedding, attention_scaling
from splitserve.kernels.rotary import rotary_embedding

MAX_LEN = 4500  # past gpt-oss's original 4096 positions

# gpt-oss-20b's config.json (its rope fields and the shapes they depend on).
GPT_OSS: dict[str, Any] = {
    "head_dim": 64,
    "hidden_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
}

# DeepSeek-V3's rope fields (legacy "type" key, integer values), its rope head of 64 dims.
DEEPSEEK_V3: dict[str, Any] = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}


def _with_rope(raw: dict[str, Any], **rope: Any) -> dict[str, Any]:
    return {**raw, "rope_scaling": {**raw["rope_scaling"], **rope}}


def _as_rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The same config as transformers 5 writes it: `rope_parameters`, theta inside."""
    params = {**raw["rope_scaling"], "rope_theta": raw["rope_theta"]}
    rest = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}
    return {**rest, "rope_parameters": params}


def _ours(raw: dict[str, Any], head_dim: int) -> RotaryEmbedding:
    rotary = RotaryEmbedding(RopeConfig.from_hf(raw), head_dim, max_len=MAX_LEN)
    rotary.reset("cpu")
    return rotary


def _hf_cos_sin(rotary: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary(torch.zeros(1), torch.arange(MAX_LEN)[None])
    return cos[0], sin[0]


def _assert_tables_equal(ours: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # gpt-oss's tables hold each pair's angle once; ours repeat it in both halves (rotate_half).
    if cos.shape[-1] != ours.head_dim:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    assert torch.equal(ours.cos, cos)
    assert torch.equal(ours.sin, sin)


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_gpt_oss_tables_and_rotation_are_transformers(form):
    raw = GPT_OSS if form == "rope_scaling" else _as_rope_parameters(GPT_OSS)
    ours = _ours(raw, 64)
    assert ours.rope.rope_type == "yarn" and ours.rope.truncate is False
    hf = GptOssRotaryEmbedding(GptOssConfig(**raw))
    assert attention_scaling(ours.rope) == hf.attention_scaling != 1.0
    cos, sin = _hf_cos_sin(hf)
    _assert_tables_equal(ours, cos, sin)

    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, MAX_LEN, (9,), generator=gen)
    q = torch.randn(9, 8, 64, generator=gen)
    k = torch.randn(9, 2, 64, generator=gen)
    got_q, got_k = ours(positions, q, k)
    # HF: [batch, heads, tokens, dim] with cos/sin [batch, tokens, dim / 2].
    want_q, want_k = gpt_oss_rotary(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[positions][None], sin[positions][None]
    )
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize(
    "raw",
    [
        DEEPSEEK_V3,
        _with_rope(DEEPSEEK_V3, mscale_all_dim=0.707),  # attention factor mscale / mscale_all_dim
        _with_rope(DEEPSEEK_V3, factor=None),  # factor = 163840 / 4096
        _as_rope_parameters(_with_rope(DEEPSEEK_V3, mscale=0.5, mscale_all_dim=0.25)),
    ],
    ids=["v3", "mscale-ratio", "derived-factor", "rope-parameters"],
)
def test_deepseek_style_tables_are_transformers(raw):
    ours = _ours(raw, 64)
    hf = DeepseekV3RotaryEmbedding(DeepseekV3Config(**raw))
    assert attention_scaling(ours.rope) == hf.attention_scaling
    _assert_tables_equal(ours, *_hf_cos_sin(hf))


@pytest.mark.parametrize(
    "rope",
    [
        {"attention_factor": 1.25, "beta_fast": 16, "beta_slow": 2},  # given, not derived
        {"truncate": False, "original_max_position_embeddings": 512},
        {"original_max_position_embeddings": None, "factor": 4.0},  # from max_position_embeddings
    ],
    ids=["attention-factor", "untruncated", "no-original-length"],
)
def test_other_yarn_settings_are_transformers(rope):
    raw = {
        "hidden_size": 512,
        "num_attention_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, **rope},
    }
    raw["rope_scaling"] = {k: v for k, v in raw["rope_scaling"].items() if v is not None}
    ours = _ours(raw, 32)
    hf = LlamaRotaryEmbedding(LlamaConfig(**raw))
    assert attention_scaling(ours.rope) == hf.attention_scaling
    _assert_tables_equal(ours, *_hf_cos_sin(hf))


def test_the_triton_rotary_kernel_reads_the_scaled_tables(device):
    ours = _ours(GPT_OSS, 64)
    ours.reset(device)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, MAX_LEN, (5,), generator=gen).to(device)
    q = torch.randn(5, 4, 64, generator=gen).to(device)
    k = torch.randn(5, 2, 64, generator=gen).to(device)
    want_q, want_k = ours(positions, q, k)
    got_q, got_k = rotary_embedding(positions, q, k, ours.cos, ours.sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_tables_built_under_the_meta_device_are_the_same():
    """A model is built on the meta device; its tables are computed on the CPU all the same."""
    with torch.device("meta"):
        rotary = RotaryEmbedding(RopeConfig.from_hf(GPT_OSS), 64, max_len=MAX_LEN)
    assert rotary.cos.is_meta
    rotary.reset("cpu")
    assert torch.equal(rotary.cos, _ours(GPT_OSS, 64).cos)


def test_unknown_rope_types_are_refused():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        RopeConfig.from_hf(_with_rope(GPT_OSS, rope_type="longrope"))
