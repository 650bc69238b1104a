"""P/D conversations send only what is new: from a conversation's second turn on, the decode
worker reuses the history it cached (its prompt and the replies it generated), the prefill
worker computes only what its own cache lacks, and the KV pushed is at most 1.2x the KV of the
tokens the decode worker did not have (whole blocks: at most one partly filled block more)."""

from __future__ import annotations

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.model_config import ModelConfig
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

TURNS, REPLY = 4, 32
PARAMS = SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True)


@pytest.mark.parametrize("kv_transport", ["nixl", "grpc"])
def test_later_turns_push_only_the_kv_the_decode_worker_lacks(tiny_models, kv_transport):
    model = tiny_models["llama"]
    cfg = ModelConfig.from_pretrained(model)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 on the CPU
    messages = random_prompts([300] + [120] * (TURNS - 1), 500, seed=51)  # system+user, users
    with running_stack(model, prefill=1, decode=1, kv_transport=kv_transport) as stack:
        stub = gateway(stack)
        prefill = next(w for w in workers(stack) if w.kind == "prefill")
        history: list[int] = []
        for turn, message in enumerate(messages):
            prompt = history + message
            sent = stats(prefill, stack).kv_bytes_sent
            reply = collect(stream(stub, prompt, PARAMS, timeout_s=60))
            assert reply.finished is not None
            pushed = stats(prefill, stack).kv_bytes_sent - sent
            cached = reply.finished.usage.cached_prompt_tokens
            uncached = len(prompt) - cached
            if turn:
                # The history the decode worker cached: every full block of the last prompt
                # and of its reply but the last token's (never computed there).
                assert cached >= (len(history) - 16) // 16 * 16, (turn, cached, len(history))
                assert pushed <= 1.2 * uncached * per_token, (turn, pushed, uncached * per_token)
            history = prompt + reply.token_ids[0]
        assert_nothing_leaks(stack)
