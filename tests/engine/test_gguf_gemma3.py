"""Gemma 3 GGUF files become HF-format checkpoints that transformers reads as it reads the GGUF
itself: a `Gemma3TextConfig` with the layer pattern, window and both RoPE bases; every tensor
equal to transformers' own dequantization (llama.cpp's `1 + w` norms undone); a tokenizer that
encodes as transformers' GGUF tokenizer does, chat template included. A tiny file written as
llama.cpp writes one runs in the fast lane; the real Gemma-3-270M (Q4_K_M) in the slow one."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from splitserve.engine.gguf_archs import hf_config
from splitserve.engine.gguf_cache import resolve_checkpoint
from splitserve.engine.gguf_loader import GGUFModel
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.launch.named_models import NAMED_MODELS
from splitserve.testing.gguf_gemma3 import CHAT_TEMPLATE, CONFIG, write_tiny_gemma3_gguf

S, F = "sliding_attention", "full_attention"
TEXTS = [
    "hello world",
    "Hello, World! the model is a user",
    "  two  spaces\nand a newline\tand a tab",
    "é ü 日本語 🎉",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
]
CHATS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "the model?"}],
]  # fmt: skip
# The config fields transformers reads from a Gemma 3 GGUF (or fills in as llama.cpp does).
COMPARED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window",
    "layer_types", "rope_parameters", "query_pre_attn_scalar", "hidden_activation",
    "final_logit_softcapping", "attn_logit_softcapping", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "model_type",
)  # fmt: skip


def _same_config(ours_dir, gguf_dir, gguf_file):
    ours = AutoConfig.from_pretrained(str(ours_dir))
    theirs = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    assert type(ours).__name__ == type(theirs).__name__ == "Gemma3TextConfig"
    assert ours.architectures == ["Gemma3ForCausalLM"]
    for name in COMPARED:
        assert getattr(ours, name) == getattr(theirs, name), name
    return ours


def _same_tokenizer(ours_dir, gguf_dir, gguf_file):
    ours = load_tokenizer(ours_dir)
    theirs = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        ), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text)), text
    return ours, theirs


# ---- the tiny file: fast lane ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the GGUF's folder, its file name, our HF-format copy)."""
    root = tmp_path_factory.mktemp("gemma3-gguf")
    path = write_tiny_gemma3_gguf(root / "tiny-gemma3.gguf")
    converted = resolve_checkpoint(path, env={"XDG_CACHE_HOME": str(root / "cache")})
    return root, path.name, converted


def test_the_config_is_transformers_gemma3_text_config_with_its_layer_pattern(tiny):
    gguf_dir, name, ours_dir = tiny
    config = _same_config(ours_dir, gguf_dir, name)
    assert config.layer_types == [S, S, S, S, S, F, S]  # every 6th layer sees everything
    assert config.sliding_window == CONFIG["sliding_window"]
    assert config.rope_parameters == {
        F: {"rope_type": "default", "rope_theta": 1_000_000.0},
        S: {"rope_type": "default", "rope_theta": 10_000.0},
    }
    assert config.query_pre_attn_scalar == CONFIG["head_dim"]
    written = json.loads((ours_dir / "config.json").read_text())
    assert written["model_type"] == "gemma3_text" and written["tie_word_embeddings"] is True


def test_every_tensor_is_transformers_own_with_the_norm_shift_undone(tiny):
    gguf_dir, name, ours_dir = tiny
    ours = load_file(str(ours_dir / "model.safetensors"))
    theirs = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=name, dtype=torch.float32
    ).state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for tensor_name, tensor in ours.items():
        assert torch.equal(tensor, theirs[tensor_name]), tensor_name
    # the file holds 1 + w for each of the six kinds of norm; ours is w again
    raw = {t.name: t for t in gguf.GGUFReader(str(gguf_dir / name)).tensors}
    for gguf_name, hf_name in [
        ("output_norm.weight", "model.norm.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.0.post_attention_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
        ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
        ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
        ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
    ]:
        stored = torch.from_numpy(raw[gguf_name].data.copy())
        assert torch.equal(ours[hf_name], stored - 1), gguf_name


def test_the_tokenizer_and_its_chat_template_come_over(tiny):
    gguf_dir, name, ours_dir = tiny
    ours, theirs = _same_tokenizer(ours_dir, gguf_dir, name)
    assert ours.chat_template == CHAT_TEMPLATE
    for chat in CHATS:
        text = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text.startswith("<bos><start_of_turn>user\n")
        assert text.endswith("<end_of_turn>\n<start_of_turn>model\n")
        assert text == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = ours.encode(text, add_special_tokens=False)  # as the gateway encodes a chat
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ids[:2] == [2, 5] and ids.count(2) == 1  # <bos><start_of_turn>, one BOS


def _meta(**extra):
    keys = {
        "context_length": 128, "embedding_length": 5376, "block_count": 62,
        "feed_forward_length": 64, "attention.head_count": 32, "attention.head_count_kv": 16,
        "attention.key_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1_000_000.0, "attention.sliding_window": 1024,
    }  # fmt: skip
    keys.update(extra)
    return {f"gemma3.{k}": v for k, v in keys.items()}


def _config(**extra):
    return hf_config("gemma3", _meta(**extra), set(), 300, {"bos": 2, "eos": 1}, "x.gguf")


def test_what_newer_files_store_is_read_and_what_none_store_is_llama_cpps_constant():
    base = _config()
    # llama.cpp scales the 27B model's (62 layers) scores by 1/sqrt(hidden / heads)
    assert base["query_pre_attn_scalar"] == 5376 // 32
    assert base["layer_types"][:6] == [S, S, S, S, S, F] and len(base["layer_types"]) == 62
    assert base["rope_parameters"][S] == {"rope_type": "default", "rope_theta": 10_000.0}
    pattern = [i % 2 == 0 for i in range(62)]  # True: sliding
    stored = _config(**{"attention.sliding_window_pattern": pattern, "rope.freq_base_swa": 5e4})
    assert stored["layer_types"] == [S if p else F for p in pattern]
    assert stored["rope_parameters"][S]["rope_theta"] == 5e4
    scaled = _config(**{"rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    assert scaled["rope_parameters"][F] == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0,
    }  # fmt: skip
    assert scaled["rope_parameters"][S]["rope_type"] == "default"  # the full layers' only
    cfg = AutoConfig.for_model(**{k: v for k, v in scaled.items() if k != "model_type"},
                               model_type="gemma3_text")  # fmt: skip
    assert cfg.rope_parameters[F]["factor"] == 8.0


# ---- the real Gemma-3-270M: slow lane --------------------------------------------------------


@pytest.mark.slow
def test_the_real_gguf_holds_several_block_types_and_its_config_is_gemma3_270ms(gemma3):
    gguf_file = NAMED_MODELS["gemma-3-270m"].gguf
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(gemma3.gguf_dir / gguf_file)).tensors}
    assert {"Q4_K", "Q6_K", "Q8_0", "F32"} <= types, types
    config = _same_config(gemma3.hf_dir, gemma3.gguf_dir, gguf_file)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (640, 18, 256)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 1)
    assert config.layer_types == ([S] * 5 + [F]) * 3
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256
    assert config.rope_parameters[F]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters[S]["rope_theta"] == 10_000.0
    assert config.vocab_size == 262_144 and config.max_position_embeddings == 32_768
    assert GGUFModel.open(gemma3.gguf_dir / gguf_file).hf_config == json.loads(
        (gemma3.hf_dir / "config.json").read_text()
    )


@pytest.mark.slow
def test_the_real_models_tensors_are_transformers_own(gemma3, gemma3_hf):
    ours = load_file(str(gemma3.hf_dir / "model.safetensors"))
    theirs = gemma3_hf.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.slow
def test_the_real_models_tokenizer_encodes_as_transformers_gguf_tokenizer(gemma3):
    ours, _ = _same_tokenizer(gemma3.hf_dir, gemma3.gguf_dir, NAMED_MODELS["gemma-3-270m"].gguf)
    # the pretrained model's file carries no chat template (its instruction-tuned one's does)
    assert ours.chat_template is None
    assert ours.encode("hello world") == [2, 23391, 1902]
    turn = ours.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False)
    assert turn[:2] == [105, 2364] and 106 in turn  # the turn markers are single tokens
