"""DeepSeek-V2 and -V3 (MLA) through the whole disaggregated path (gateway -> prefill worker ->
KV over NIXL or gRPC -> decode worker), real processes: greedy float32 tokens equal HF
transformers' over 64 steps, a chat completion through the OpenAI API is HF's greedy answer on
the model's chat template, the KV pushed is exactly the latent blocks of the uncached prompt
tokens (a prefix the decode worker caches is not sent again), and nothing leaks."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.testing.tiny_deepseek import TINY_DEEPSEEK, make_tiny_deepseek_model
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

STEPS, BLOCK_SIZE = 64, 16  # the workers' default block size
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
LENGTHS = [1, 17, 45, 130]  # across block edges and past YaRN's original context (64)
SHARED = 64  # tokens of the last prompt that a later one repeats (whole blocks)


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {v: make_tiny_deepseek_model(root / v, v) for v in TINY_DEEPSEEK}


def latent_block_bytes(model_dir: Path) -> int:
    """One block of the latent pool: block_size x (kv_lora_rank + qk_rope_head_dim) x 4 bytes
    (float32 on the CPU) x layers."""
    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.mla is not None
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    return BLOCK_SIZE * latent * 4 * cfg.num_layers


@pytest.mark.parametrize("kv_transport", ["nixl", "grpc"])
@pytest.mark.parametrize("variant", TINY_DEEPSEEK)
def test_deepseek_through_prefill_and_decode_equals_hf(deepseek_models, variant, kv_transport):
    model_dir = deepseek_models[variant]
    block_bytes = latent_block_bytes(model_dir)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = random_prompts(LENGTHS, vocab, seed=43)
    # The last prompt's first SHARED tokens (cached on the decode worker by then) and new ones.
    prompts.append(prompts[-1][:SHARED] + random_prompts([50], vocab, seed=44)[0])
    with running_stack(
        model_dir, prefill=1, decode=1, kv_transport=kv_transport, http_port=0
    ) as stack:
        stub = gateway(stack)
        prefill = next(w for w in workers(stack) if w.kind == "prefill")
        decode = next(w for w in workers(stack) if w.kind == "decode")
        for prompt in prompts:
            sent, received = stats(prefill, stack).kv_bytes_sent, stats(decode).kv_bytes_received
            result = collect(stream(stub, prompt, GREEDY, timeout_s=120))
            assert result.token_ids[0] == hf_greedy(model_dir, tuple(prompt), STEPS), (
                f"{variant} over {kv_transport}: a prompt of {len(prompt)} tokens diverged from HF"
            )
            assert result.finished is not None
            cached = result.finished.usage.cached_prompt_tokens
            if prompt is prompts[-1]:
                assert cached == SHARED, "the shared prefix was sent again"
            else:
                assert cached == 0
            # Exactly the latent blocks of the uncached tokens: from the first uncached block
            # (cached tokens are whole blocks) to the prompt's last, partly filled or not.
            blocks = -(-len(prompt) // BLOCK_SIZE) - cached // BLOCK_SIZE
            pushed = stats(prefill, stack).kv_bytes_sent - sent
            landed = stats(decode).kv_bytes_received - received
            assert pushed == landed == blocks * block_bytes, (len(prompt), cached, pushed)
        chat = [{"role": "user", "content": "Name three colours."}]
        client = openai.OpenAI(base_url=stack.http_url, api_key="-", max_retries=0, timeout=120)
        got = client.chat.completions.create(
            model=model_dir.name, messages=chat, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokenizer = load_tokenizer(model_dir)
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        want = tokenizer.decode(hf_greedy(model_dir, tuple(ids), 16), skip_special_tokens=True)
        assert got.choices[0].message.content == want
        assert_nothing_leaks(stack)
