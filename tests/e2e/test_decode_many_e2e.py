"""A gateway with one DecodeMany call per decode worker carrying its streams (`--decode-many
true`) and with a Decode call per stream (the default): outputs equal the offline engine's, a
cancelled stream frees its blocks, and nothing leaks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
LENGTHS = [3, 40, 90, 17, 150, 64]


@pytest.mark.parametrize("decode_many", ["true", "false"])
def test_decode_many_gives_the_offline_tokens_and_frees_a_cancelled_stream(
    tiny_models, decode_many
):
    model_dir = tiny_models["llama"]
    llm = LLM(model_dir)
    prompts = random_prompts(LENGTHS, llm.engine.model_config.vocab_size, seed=41)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with running_stack(
        model_dir, prefill=1, decode=1, kv_transport="grpc",
        extra_gateway_args=("--decode-many", decode_many),
    ) as s:  # fmt: skip
        stub = gateway(s)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: collect(stream(stub, p, GREEDY, timeout_s=120)), prompts))
        assert [r.token_ids[0] for r in got] == expected
        # a stream the client leaves mid-way: its request is aborted and its blocks freed
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        responses = stream(stub, prompts[1], long, timeout_s=120)
        next(iter(responses))
        responses.cancel()
        assert_nothing_leaks(s)
