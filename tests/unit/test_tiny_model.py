"""Tests for the offline tiny-checkpoint generator in testing.tiny_model."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.testing.tiny_model import SUPPORTED_TINY_ARCHS, make_tiny_model
from splitserve.testing.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One default checkpoint per arch, shared by the read-only tests."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in SUPPORTED_TINY_ARCHS}


def _load(path, dtype=torch.float32):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    return model.eval(), info


def _tensor_shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def _read_json(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_each_arch_loads_in_transformers_with_no_missing_weights_and_finite_logits(
    checkpoints, arch
):
    path = checkpoints[arch]
    assert {p.name for p in path.iterdir()} == EXPECTED_FILES
    model, info = _load(path)
    assert not any(info.values()), info
    ids = torch.tensor([[5, 100, 200, 300, 400, 7]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 6, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_arch_specific_layout_covers_gqa_mha_tied_untied_biases_and_qk_norm(checkpoints):
    llama = _tensor_shapes(checkpoints["llama"])
    assert llama["model.layers.0.self_attn.k_proj.weight"] == (32, 64)  # 2 KV heads x 16
    assert "lm_head.weight" in llama
    assert not any(k.endswith(".bias") for k in llama)

    mistral = _tensor_shapes(checkpoints["mistral"])
    assert mistral["model.layers.1.self_attn.k_proj.weight"] == (64, 64)  # MHA
    assert "lm_head.weight" in mistral

    qwen2 = _tensor_shapes(checkpoints["qwen2"])
    assert qwen2["model.layers.0.self_attn.q_proj.bias"] == (64,)
    assert qwen2["model.layers.0.self_attn.v_proj.bias"] == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert "lm_head.weight" not in qwen2

    qwen3 = _tensor_shapes(checkpoints["qwen3"])
    assert qwen3["model.layers.0.self_attn.q_proj.weight"] == (128, 64)  # 4 heads x head_dim 32
    assert qwen3["model.layers.0.self_attn.o_proj.weight"] == (64, 128)
    assert qwen3["model.layers.1.self_attn.q_norm.weight"] == (32,)
    assert qwen3["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert "lm_head.weight" not in qwen3


def test_config_uses_legacy_rope_keys_and_llama3_scaling_reaches_transformers(checkpoints):
    cfg = _read_json(checkpoints["llama"] / "config.json")
    assert cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 256
    model, _ = _load(checkpoints["llama"])
    rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
    assert rope["rope_type"] == "llama3"
    assert _read_json(checkpoints["qwen2"] / "config.json")["rope_theta"] == 1000000.0


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_model_vocab_and_special_ids_match_the_tokenizer(checkpoints, arch):
    path = checkpoints[arch]
    cfg = _read_json(path / "config.json")
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg["vocab_size"] == len(tok)
    assert cfg["bos_token_id"] == tok.bos_token_id == tok.convert_tokens_to_ids("<|bos|>")
    assert cfg["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|eos|>")
    assert cfg["pad_token_id"] == tok.pad_token_id
    gen_cfg = _read_json(path / "generation_config.json")
    assert gen_cfg["eos_token_id"] == cfg["eos_token_id"]
    assert tok.model_max_length == cfg["max_position_embeddings"] == 2048


def _random_unicode(rng: random.Random, length: int) -> str:
    # Mix ASCII, Latin-1, CJK, emoji and arbitrary BMP/astral code points (minus surrogates).
    ranges = [(0x20, 0x7E), (0x09, 0x0A), (0xA0, 0x17F), (0x3040, 0x30FF), (0x4E00, 0x9FFF)]
    ranges += [(0x1F300, 0x1FAFF), (0x0, 0xD7FF), (0xE000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(length))


@pytest.fixture(scope="module")
def unicode_texts():
    rng = random.Random(1234)
    return [
        "",
        " ",
        "  leading and trailing spaces  ",
        "Hello, world! It's 3.14159 -- café, naïve, 日本語, 🙂🚀👍🏽",
        "def f(x):\n\treturn x ** 2  # comment\r\n",
        "a . b , c ? d ! e 's 're 12345",
        "\x00\x01 control \u200b zero-width \U0010ffff",
        "cafe\u0301 (decomposed accent)",
    ] + [_random_unicode(rng, rng.randint(1, 60)) for _ in range(200)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_tokenizer_round_trips_arbitrary_unicode_text(checkpoints, unicode_texts, arch):
    raw = build_tokenizer()
    tok = AutoTokenizer.from_pretrained(checkpoints[arch])
    for text in unicode_texts:
        assert raw.decode(raw.encode(text).ids, skip_special_tokens=False) == text
        assert tok.decode(tok.encode(text)) == text


def test_qwen2_tokenizer_round_trips_nfc_text_like_transformers_forces(checkpoints, unicode_texts):
    # transformers imposes Qwen2's NFC normaliser on model_type "qwen2", so exact round trips
    # hold only up to NFC there; the file carries the same pipeline so both sides agree.
    tok = AutoTokenizer.from_pretrained(checkpoints["qwen2"])
    assert type(tok).__name__ == "Qwen2Tokenizer"
    for text in unicode_texts:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_raw_tokenizer_json_and_auto_tokenizer_give_identical_ids(checkpoints, unicode_texts, arch):
    raw = Tokenizer.from_file(str(checkpoints[arch] / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(checkpoints[arch])
    for text in unicode_texts + ["<|im_start|>user\nhi<|im_end|>\n"]:
        assert raw.encode(text).ids == tok.encode(text), text


def test_tokenizer_is_a_real_bpe_with_single_id_special_tokens(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["llama"])
    assert 500 <= len(tok) <= 520
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    assert len(ids) < 0.7 * len(text)  # merges learned: far fewer ids than bytes
    assert ids[0] != tok.bos_token_id  # no automatic BOS
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special)) == 1


def test_chat_template_renders_chatml_with_generation_prompt(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["qwen2"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.decode(ids) == text


def test_same_seed_is_byte_identical_and_other_seed_changes_only_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen3", seed=7)
    b = make_tiny_model(tmp_path / "b", "qwen3", seed=7)
    c = make_tiny_model(tmp_path / "c", "qwen3", seed=8)
    for name in EXPECTED_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_checkpoint_loads_with_logits_identical_to_single_file(tmp_path, arch):
    single = make_tiny_model(tmp_path / "single", arch, seed=3)
    sharded = make_tiny_model(tmp_path / "sharded", arch, seed=3, num_shards=3)
    shard_names = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    assert all((sharded / n).exists() for n in shard_names)

    index = _read_json(sharded / "model.safetensors.index.json")
    shapes = _tensor_shapes(single)
    assert set(index["weight_map"]) == set(shapes)
    assert set(index["weight_map"].values()) == set(shard_names)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    assert index["metadata"]["total_size"] == 4 * numel  # float32

    ids = torch.tensor([[9, 8, 7, 300, 301, 302, 5]])
    m_single, _ = _load(single)
    m_sharded, info = _load(sharded)
    assert not any(info.values()), info
    with torch.no_grad():
        assert torch.equal(m_single(ids).logits, m_sharded(ids).logits)


def test_config_overrides_are_merged_last_and_weight_shapes_follow(tmp_path):
    path = make_tiny_model(
        tmp_path, "llama", config_overrides={"rope_scaling": None, "num_key_value_heads": 4}
    )
    cfg = _read_json(path / "config.json")
    assert cfg["rope_scaling"] is None
    assert cfg["num_key_value_heads"] == 4
    assert _tensor_shapes(path)["model.layers.0.self_attn.k_proj.weight"] == (64, 64)
    _, info = _load(path)
    assert not any(info.values()), info


def test_greedy_decoding_is_varied_with_clear_margins_and_float64_agrees(checkpoints):
    # Guards the init scales: the engine is checked against HF token for token in float32, which
    # is only meaningful if argmaxes are well separated and the model does not just loop.
    for arch, path in checkpoints.items():
        model, _ = _load(path)
        model64, _ = _load(path, dtype=torch.float64)
        gen = torch.Generator().manual_seed(0)
        distinct = set()
        for _ in range(3):
            prompt = torch.randint(5, model.config.vocab_size, (1, 12), generator=gen)
            out = model.generate(
                prompt,
                max_new_tokens=24,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=model.config.pad_token_id,
            )
            new_tokens = out.sequences[0, 12:].tolist()
            assert len(set(new_tokens[:6])) > 1, (arch, new_tokens)  # not stuck from step 1
            distinct.update(new_tokens)
            top2 = torch.stack([s[0].topk(2).values for s in out.scores])
            assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, arch
            with torch.no_grad():
                logits64 = model64(out.sequences[:, :-1]).logits[0, 11:]
            assert logits64.argmax(-1).tolist() == new_tokens, arch
        # A collapsed model repeats one or two tokens; 72 steps here give 18+ distinct ones.
        assert len(distinct) >= 12, (arch, distinct)


def test_unknown_arch_and_bad_shard_count_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        make_tiny_model(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="num_shards"):
        make_tiny_model(tmp_path, "llama", num_shards=0)


def test_rebuilding_into_the_same_directory_replaces_the_weight_layout(tmp_path):
    make_tiny_model(tmp_path, "mistral", num_shards=2)
    make_tiny_model(tmp_path, "mistral")
    assert {p.name for p in tmp_path.iterdir()} == EXPECTED_FILES
    make_tiny_model(tmp_path, "mistral", num_shards=2)
    assert not (tmp_path / "model.safetensors").exists()
