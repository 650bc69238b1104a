"""Sliding layers' KV in a window pool, through the whole disaggregated path (gateway -> prefill
worker -> NIXL -> decode worker, real processes, real redis-server): a tiny Gemma 3 whose window
(32 tokens, two blocks of 16) prompts of a few hundred tokens cross. Greedy float32 tokens equal
HF transformers' over 64 steps (and their log-probabilities HF's: the tiny model's greedy
margins alone would hide a sliding layer reading wrong KV), over NIXL and gRPC; and each push
moves exactly the window-pool figure: the full
layer's KV of every block sent, the sliding layers' KV only of the blocks the decode side's
first query sees, all computed here from the checkpoint's shape. A decode-side prefix hit (the
next turn of a conversation) sends only the uncached suffix."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.tokenizer import load_tokenizer
from tests.conftest import made_once
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import hf_greedy, hf_logprobs, random_prompts

pytestmark = pytest.mark.slow

STEPS = 64
BLOCK = 16
WINDOW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
LENGTHS = [300, 257, 200]  # past the window many times over, on and off block edges


@pytest.fixture(scope="module")
def gemma3_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve.testing.tiny_families import make_tiny_family_model

    def make(root: Path) -> None:
        make_tiny_family_model(root, "gemma3", config_overrides={"sliding_window": WINDOW})

    return made_once(tmp_path_factory, "gemma3-window32", make)


def pushed_bytes(model_dir: Path, prompt_len: int, num_cached: int) -> tuple[int, int]:
    """(bytes a push of a `prompt_len`-token prompt moves with a window pool, bytes it moves
    keeping every layer in every block), `num_cached` leading tokens cached on the decode side,
    from the checkpoint's shape: a block's page of one layer is keys and values of BLOCK tokens
    x KV heads x head_dim float32; full layers go for every block sent, sliding layers only for
    the blocks holding a position that the query of the prompt's last token (at prompt_len - 1:
    the decode side reserves for it) sees, (prompt_len - 1 - WINDOW, prompt_len - 1]."""
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["layer_types"]
    page = 2 * BLOCK * config["num_key_value_heads"] * config["head_dim"] * 4
    full = sum(t == "full_attention" for t in layers)
    sliding = len(layers) - full
    first, end = num_cached // BLOCK, -(-prompt_len // BLOCK)
    # block b holds positions [b*BLOCK, (b+1)*BLOCK): seen if its last one is in that window
    seen = [b for b in range(first, end) if (b + 1) * BLOCK - 1 > prompt_len - 1 - WINDOW]
    window = (end - first) * full * page + len(seen) * sliding * page
    return window, (end - first) * len(layers) * page


def assert_logprobs_are_hf(stack, model_dir: Path, prompt: list[int]) -> None:
    """A completion of `prompt` through the OpenAI API: each position's top log-probabilities
    are HF's (the tiny model's greedy token is near certain; the runners-up are where a sliding
    layer reading wrong KV shows)."""
    client = openai.OpenAI(base_url=stack.http_url, api_key="-", max_retries=0, timeout=120)
    got = client.completions.create(
        model=model_dir.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=5,
        extra_body={"ignore_eos": True},
    ).choices[0].logprobs  # fmt: skip
    assert got is not None and got.top_logprobs is not None
    continuation = hf_greedy(model_dir, tuple(prompt), 8)
    want = hf_logprobs(model_dir, prompt, continuation)
    tokenizer = load_tokenizer(model_dir)
    for i, top in enumerate(got.top_logprobs):
        for text, logprob in top.items():
            ids = [t for t in range(want.shape[1]) if tokenizer.decode([t]) == text]
            assert any(abs(float(want[i, t]) - logprob) < 1e-4 for t in ids), (i, text, logprob)


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_window_pool_through_prefill_and_decode_equals_hf_and_moves_the_window_bytes(
    gemma3_window: Path, transport: str
) -> None:
    prompts = random_prompts(LENGTHS, 500, seed=43)
    args = ("--block-size", str(BLOCK))
    with running_stack(
        str(gemma3_window), prefill=1, decode=1, kv_transport=transport, worker_args=args,
        http_port=0,
    ) as stack:  # fmt: skip
        stub = gateway(stack)
        decode = next(w for w in workers(stack) if w.kind == "decode")
        outputs = []
        for prompt in prompts:
            before = stats(decode).kv_bytes_received
            result = collect(stream(stub, prompt, GREEDY, timeout_s=120))
            moved = stats(decode).kv_bytes_received - before
            assert result.token_ids[0] == hf_greedy(gemma3_window, tuple(prompt), STEPS), (
                f"a prompt of {len(prompt)} tokens diverged from HF"
            )
            window, every = pushed_bytes(gemma3_window, len(prompt), 0)
            assert moved == window < every, (len(prompt), moved, window, every)
            outputs.append(result.token_ids[0])
        # a prompt no worker caches: every block's KV comes from the push
        assert_logprobs_are_hf(stack, gemma3_window, random_prompts([200], 500, seed=45)[0])
        # The next turn: the first conversation, its answer and a new question. The decode
        # worker caches the blocks of the prompt and answer (their last window's slots idle
        # there), so only the new tokens' blocks are pushed.
        turn = [*prompts[0], *outputs[0], *random_prompts([50], 500, seed=44)[0]]
        before = stats(decode).kv_bytes_received
        result = collect(stream(stub, turn, GREEDY, timeout_s=120))
        moved = stats(decode).kv_bytes_received - before
        assert result.token_ids[0] == hf_greedy(gemma3_window, tuple(turn), STEPS)
        computed = len(prompts[0]) + STEPS - 1  # the answer's last token has no KV there
        cached = computed // BLOCK * BLOCK
        window, _ = pushed_bytes(gemma3_window, len(turn), cached)
        assert moved == window, (moved, window, cached)
        assert_nothing_leaks(stack)
