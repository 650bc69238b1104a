"""Each Mixture-of-Experts and mixed-attention family through the whole disaggregated path
(gateway -> prefill worker -> KV over NIXL -> decode worker), real processes: greedy float32
tokens equal HF transformers' over 64 steps, a chat completion through the OpenAI API is HF's
greedy answer on the model's chat template, and nothing leaks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.testing.tiny_families import TINY_FAMILIES
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

STEPS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
LENGTHS = [1, 17, 45, 130]  # past the sliding windows (16, 48 tokens) and block edges


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_family_through_prefill_and_decode_equals_hf(tiny_families, family):
    model_dir = tiny_families[family]
    prompts = random_prompts(LENGTHS, 500, seed=41)
    with running_stack(
        model_dir, prefill=1, decode=1, kv_transport="nixl", http_port=0
    ) as stack:
        stub = gateway(stack)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(lambda p: collect(stream(stub, p, GREEDY, timeout_s=120)), prompts)
            )
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids[0] == hf_greedy(model_dir, tuple(prompt), STEPS), (
                f"{family}: prompt of {len(prompt)} tokens diverged from HF"
            )
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
        decode = next(w for w in workers(stack) if w.kind == "decode")
        assert stats(decode).kv_bytes_received > 0
        assert_nothing_leaks(stack)
