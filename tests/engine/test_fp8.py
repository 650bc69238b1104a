"""FP8 weights on the CPU: compressed-tensors checkpoints load from real files, and the engine's
dequantized FP8 arithmetic matches an explicit torch reference of the same quantization token
for token (HF transformers' model with every decoder projection replaced by that reference, and
a Mixture-of-Experts block's experts by their quantized-then-dequantized weights)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from splitserve.engine.llm import LLM
from splitserve.engine.quantization import weight_bytes
from splitserve.engine.sampling_params import SamplingParams
from splitserve.testing.fp8_checkpoint import STATIC_INPUT_SCALE, quantize_checkpoint
from tests.engine.hf_oracle import random_prompts

E4M3, E4M3_MAX = torch.float8_e4m3fn, 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 12


class ReferenceFp8Linear(nn.Module):
    """W8A8 written out: the weight quantized per output channel (or per tensor), each input
    row per token (or by a static scale), both widened to float32, multiplied, accumulated."""

    def __init__(self, linear: nn.Linear, per_channel: bool, static: float | None) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        self.w_scale = (amax / E4M3_MAX).clamp(min=1e-12).reshape(-1, 1)
        self.w_q = (w / self.w_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.static = static

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        if self.static is None:
            x_scale = (rows.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        else:
            x_scale = torch.full((rows.shape[0], 1), self.static)
        x_q = (rows / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        out = (x_q.float() * x_scale) @ (self.w_q.float() * self.w_scale).t()
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], -1)


def dequantize_experts_(experts: nn.Module) -> None:
    """Weight-only FP8 written out: each stacked expert weight [E, N, K] quantized per expert and
    output channel, then put back dequantized (q * scale, float32) for HF's own expert loop."""
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name).detach().float()
        scale = (w.abs().amax(dim=2, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        with torch.no_grad():
            getattr(experts, name).copy_(q.float() * scale)


def reference_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    per_channel: bool,
    static: float | None,
    *,
    experts: bool = True,
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if hasattr(parent, name):
                    ref = ReferenceFp8Linear(getattr(parent, name), per_channel, static)
                    setattr(parent, name, ref)
        if experts and hasattr(layer.mlp, "experts"):
            dequantize_experts_(layer.mlp.experts)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


def engine_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def fp8_params(llm: LLM) -> Iterator[tuple[str, torch.Tensor]]:
    model = llm.engine.model
    return ((n, p) for n, p in model.named_parameters() if p.dtype == E4M3)


@pytest.mark.parametrize(
    ("arch", "strategy", "static"),
    [("llama", "channel", False), ("qwen2", "tensor", False), ("qwen3", "channel", True)],
)
def test_a_compressed_tensors_checkpoint_matches_the_explicit_reference(
    tiny_models: dict[str, Path], tmp_path: Path, arch: str, strategy: str, static: bool
) -> None:
    src = tiny_models[arch]
    fp8_dir = quantize_checkpoint(src, tmp_path / "fp8", strategy=strategy, static_input=static)
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    llm = LLM(fp8_dir, device="cpu", max_num_batched_tokens=64)
    names = [n for n, _ in fp8_params(llm)]
    assert len(names) == 7 * len(llm.engine.model.model.layers)
    assert not any("lm_head" in n or "embed" in n for n in names)

    prompts = random_prompts([5, 17, 40], vocab_size=200, seed=3)
    expected = reference_greedy(
        src, prompts, strategy == "channel", STATIC_INPUT_SCALE if static else None
    )
    assert engine_greedy(llm, prompts) == expected


def test_quantizing_at_load_equals_the_stored_checkpoint(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    src = tiny_models["llama"]
    prompts = random_prompts([9, 30], vocab_size=200, seed=5)
    llm = LLM(src, device="cpu", quantization="fp8")
    assert len(list(fp8_params(llm))) == 7 * 2  # every projection of both layers
    at_load = engine_greedy(llm, prompts)
    stored = engine_greedy(LLM(quantize_checkpoint(src, tmp_path / "fp8"), device="cpu"), prompts)
    assert at_load == stored == reference_greedy(src, prompts, per_channel=True, static=None)


def test_unreadable_quantization_configs_fail_with_their_names(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    fp8_dir = quantize_checkpoint(tiny_models["llama"], tmp_path / "fp8")
    with pytest.raises(ValueError, match="can't be run unquantized"):
        LLM(fp8_dir, quantization="none")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        LLM(fp8_dir)
    with pytest.raises(ValueError, match="quantization must be"):
        LLM(tiny_models["llama"], quantization="int3")


def test_make_tiny_model_writes_an_fp8_checkpoint_that_loads(tmp_path: Path) -> None:
    from splitserve.cli import main

    assert main(["make-tiny-model", str(tmp_path / "m"), "--quantization", "fp8"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] == "float"
    llm = LLM(tmp_path / "m", device="cpu")
    assert len(list(fp8_params(llm))) == 14
    assert len(engine_greedy(llm, [[5, 6, 7]])[0]) == NEW_TOKENS


def test_moe_experts_quantized_at_load_match_the_explicit_reference(
    tiny_families: dict[str, Path],
) -> None:
    src = tiny_families["qwen3_moe"]  # 3 layers: sparse, dense, sparse; 8 experts, H 64, I 48
    llm = LLM(src, device="cpu", quantization="fp8")
    model = llm.engine.model
    moes = [m for n, m in model.named_modules() if n.endswith("mlp") and hasattr(m, "experts")]
    assert len(moes) == 2
    for moe in moes:
        experts = moe.experts
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == E4M3
        assert experts.gate_up_proj_scale.shape == (8, 96)
        assert experts.down_proj_scale.shape == (8, 64)
        assert experts.gate_up_proj_scale.dtype == experts.down_proj_scale.dtype == torch.float32
        assert moe.gate.weight.dtype == torch.float32  # the router stays in the model's dtype
    # 4 attention projections a layer, the dense layer's 3, two expert weights a sparse layer.
    assert len(list(fp8_params(llm))) == 4 * 3 + 3 + 2 * 2

    # float32 -> 1 byte per FP8 element, plus 4 bytes per scale.
    fp8_elements = sum(p.numel() for _, p in fp8_params(llm))
    scale_elements = sum(p.numel() for n, p in model.named_parameters() if n.endswith("scale"))
    unquantized = weight_bytes(LLM(src, device="cpu").engine.model)
    assert weight_bytes(model) == unquantized - 3 * fp8_elements + 4 * scale_elements

    prompts = random_prompts([5, 17, 40], vocab_size=llm.engine.model_config.vocab_size, seed=3)
    expected = reference_greedy(src, prompts, per_channel=True, static=None)
    assert engine_greedy(llm, prompts) == expected
    # The experts' quantization is seen: with 16-bit experts the reference diverges.
    assert reference_greedy(src, prompts, per_channel=True, static=None, experts=False) != expected


def test_a_compressed_tensors_moe_checkpoint_is_refused_clearly(
    tiny_families: dict[str, Path], tmp_path: Path
) -> None:
    fp8_dir = quantize_checkpoint(tiny_families["qwen3_moe"], tmp_path / "fp8")
    with pytest.raises(ValueError, match="Mixture-of-Experts.*--quantization fp8"):
        LLM(fp8_dir, device="cpu")
