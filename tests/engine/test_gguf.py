"""GGUF checkpoints: every supported block type dequantizes to `gguf`'s own reference, llama.cpp's
Q/K permutation is undone (a GGUF of a tiny checkpoint gives HF's tokens), and what cannot run
fails with an error naming it."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.gguf_cache import resolve_checkpoint
from splitserve.engine.gguf_loader import SUPPORTED_TYPES, GGUFError, GGUFModel
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.testing.gguf_checkpoint import (
    RawTensor,
    gguf_name,
    hf_to_gguf,
    llama_cpp_permute,
    random_blocks,
    write_gguf,
)
from splitserve.testing.tiny_model import make_tiny_model
from tests.engine.hf_oracle import hf_greedy, random_prompts

# A one-layer Llama whose rows are 256 wide: a K-quant block holds 256 values.
CONFIG = {
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}  # fmt: skip
SHAPES = {
    "model.embed_tokens.weight": (256, 256),
    "model.layers.0.input_layernorm.weight": (256,),
    "model.layers.0.self_attn.q_proj.weight": (256, 256),
    "model.layers.0.self_attn.k_proj.weight": (128, 256),
    "model.layers.0.self_attn.v_proj.weight": (128, 256),
    "model.layers.0.self_attn.o_proj.weight": (256, 256),
    "model.layers.0.post_attention_layernorm.weight": (256,),
    "model.layers.0.mlp.gate_proj.weight": (256, 256),
    "model.layers.0.mlp.up_proj.weight": (256, 256),
    "model.layers.0.mlp.down_proj.weight": (256, 256),
    "model.norm.weight": (256,),
    "lm_head.weight": (256, 256),
}
# What quantizing loses, as a share of the largest weight (types `gguf` can quantize).
QUANTIZED_TOLERANCE = {
    "F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_0": 0.05, "Q5_1": 0.05,
    "Q4_0": 0.1, "Q4_1": 0.1,
}  # fmt: skip


def _tensors(qtype: str) -> dict[str, np.ndarray | RawTensor]:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray | RawTensor] = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        if len(shape) == 2 and qtype not in QUANTIZED_TOLERANCE:  # dequantize-only types
            tensors[name] = random_blocks(qtype, *shape, seed=i)
        else:
            tensors[name] = rng.normal(0, 0.05, shape).astype(np.float32)
    return tensors


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_each_supported_type_dequantizes_to_ggufs_reference(tmp_path, qtype):
    written = _tensors(qtype)
    path = write_gguf(tmp_path / f"{qtype}.gguf", "llama", CONFIG, written, qtype)
    loaded = dict(GGUFModel.open(path).tensors())
    reference = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert sorted(loaded) == sorted(SHAPES)
    for name, shape in SHAPES.items():
        ours = loaded[name]
        assert ours.shape == shape, name
        raw = reference[gguf_name(name)]
        assert raw.tensor_type.name == (qtype if len(shape) == 2 else "F32"), name
        expected = gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type).reshape(shape)
        # NOTE: the file holds Q and K as llama.cpp permuted them; ours must be HF's rows.
        heads = {"q_proj": 4, "k_proj": 2}.get(name.split(".")[-2])
        in_file = llama_cpp_permute(ours, heads) if heads else ours
        np.testing.assert_array_equal(in_file.astype(np.float32), expected, err_msg=name)
        original = written[name]
        if not isinstance(original, RawTensor):  # and close to what was quantized
            scale = float(np.abs(original).max())
            err = float(np.abs(ours.astype(np.float32) - original).max())
            assert err <= QUANTIZED_TOLERANCE.get(qtype, 0.0) * scale + 1e-12, (name, err)


def test_unpermuting_restores_hf_rows_of_query_and_key_heads(tmp_path):
    rows = np.arange(2 * 8, dtype=np.float32).reshape(16, 1)  # 2 heads of 8: halves of 4
    permuted = llama_cpp_permute(rows, 2)
    assert permuted[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # interleaved rotary pairs
    from splitserve.engine.gguf_loader import unpermute_qk

    np.testing.assert_array_equal(unpermute_qk(permuted, 2), rows)


TINY = {
    # GQA with llama.cpp's permutation (rope scaling off: GGUF stores it as rope_freqs)
    "llama": {"rope_scaling": None},
    "qwen2": {},  # q/k/v biases, tied embeddings, no permutation
    "qwen3": {},  # q/k norms, head_dim != hidden / heads
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """arch -> (the HF checkpoint, its GGUF file in F32: the same weights exactly)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, overrides in TINY.items():
        hf = make_tiny_model(root / arch, arch, config_overrides=overrides)
        out[arch] = (hf, hf_to_gguf(hf, root / f"tiny-{arch}.gguf"))
    return out


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


@pytest.mark.parametrize("arch", list(TINY))
def test_a_gguf_of_a_tiny_checkpoint_gives_hfs_greedy_tokens(tiny_gguf, arch):
    hf_dir, gguf_file = tiny_gguf[arch]
    llm = LLM(gguf_file, dtype="float32", device="cpu")
    prompts = random_prompts([3, 17, 40], llm.engine.model_config.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_dir, tuple(prompt), 16)


def test_a_directory_holding_a_gguf_loads_its_config_and_tokenizer(tiny_gguf, tmp_path):
    hf_dir, gguf_file = tiny_gguf["llama"]
    holder = tmp_path / "my-model"
    holder.mkdir()
    shutil.copy(gguf_file, holder / gguf_file.name)
    ours_cfg, hf_cfg = ModelConfig.from_pretrained(holder), ModelConfig.from_pretrained(hf_dir)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_model_len", "rope", "tie_word_embeddings",
              "bos_token_id", "eos_token_ids")  # fmt: skip
    assert [getattr(ours_cfg, f) for f in fields] == [getattr(hf_cfg, f) for f in fields]
    assert resolve_checkpoint(holder).name == "my-model"  # the name services call it by
    ours, theirs = load_tokenizer(holder), load_tokenizer(hf_dir)
    text = "def fibonacci(n):\n    return n  <|im_end|> héllo"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )


def test_conversion_happens_once_per_file(tiny_gguf):
    _, gguf_file = tiny_gguf["qwen3"]
    first = resolve_checkpoint(gguf_file)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint(gguf_file) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "x.gguf", "gpt2", CONFIG, {})
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gpt2'.*supported: llama"):
        ModelConfig.from_pretrained(path)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    tensors = _tensors("F32")
    blocks = np.zeros((256, 256 // 256 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.TQ2_0][1]))
    tensors["model.layers.0.mlp.up_proj.weight"] = RawTensor(blocks.astype(np.uint8), "TQ2_0")
    path = write_gguf(tmp_path / "x.gguf", "llama", CONFIG, tensors)
    named = r"unsupported GGUF tensor type\(s\) TQ2_0 .*blk\.0\.ffn_up.*supported: F32"
    with pytest.raises(GGUFError, match=named):
        LLM(path, device="cpu")


def test_the_cli_reports_a_bad_gguf_in_one_line(tmp_path, capsys):
    from splitserve.cli import main

    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all")
    assert main(["offline", "hi", "--model", str(tmp_path / "broken.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("splitserve offline: error:") and "not a readable GGUF" in err
    assert len(err.splitlines()) == 1
