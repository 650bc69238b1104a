"""Disaggregation across tensor-parallel degrees, end to end: a prefill worker at TP=2 feeding a
decode worker at TP=1, and the reverse, over the gRPC KV transport (real processes, real
redis-server); tokens equal HF's and nothing leaks on any worker or in Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
TP2 = ("--tensor-parallel-size", "2")


@pytest.mark.parametrize(
    ("prefill_args", "decode_args"), [(TP2, ()), ((), TP2)], ids=["P-tp2-D-tp1", "P-tp1-D-tp2"]
)
def test_prefill_and_decode_at_different_degrees_give_hf_tokens(
    tiny_models, prefill_args, decode_args
):
    model = tiny_models["qwen3"]
    prompts = random_prompts([3, 40, 90], 200, seed=30)
    with running_stack(
        model,
        prefill=1,
        decode=1,
        kv_transport="grpc",
        extra_prefill_args=prefill_args,
        extra_decode_args=decode_args,
    ) as stack:
        stub = gateway(stack)
        with ThreadPoolExecutor(len(prompts)) as pool:
            done = list(
                pool.map(lambda p: collect(stream(stub, p, GREEDY, timeout_s=120)), prompts)
            )
        for prompt, completion in zip(prompts, done, strict=True):
            assert completion.token_ids[0] == hf_greedy(model, tuple(prompt), MAX_NEW)
        assert_nothing_leaks(stack)
