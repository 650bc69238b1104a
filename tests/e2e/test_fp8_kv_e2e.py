"""The disaggregated path with an FP8 KV cache: prefill and decode workers hold e4m3 blocks,
push them as stored over each transport, and stream the offline engine's tokens (same FP8
cache); a worker with another KV dtype is refused when it joins."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.kv_transfer.registry import BlockSizeMismatch, WorkerInfo
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LENGTHS = [3, 17, 40, 90, 130, 200]


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_fp8_kv_disaggregated_greedy_equals_offline(tiny_models, transport):
    model_dir = tiny_models["llama"]
    llm = LLM(model_dir, device="cpu", kv_cache_dtype="fp8")
    prompts = random_prompts(LENGTHS, llm.engine.model_config.vocab_size, seed=5)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    fp8 = ("--kv-cache-dtype", "fp8")
    with running_stack(model_dir, 1, 1, kv_transport=transport, worker_args=fp8) as stack:
        assert {w.kv_dtype for w in workers(stack)} == {"float8_e4m3fn"}
        stub = gateway(stack)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(lambda p: collect(stream(stub, p, GREEDY, timeout_s=120)), prompts)
            )
        assert [r.token_ids[0] for r in results] == expected
        received = sum(stats(w).kv_bytes_received for w in workers(stack) if w.kind == "decode")
        # e4m3: one byte per element; the tiny model's blocks are 2 layers x 2 x 16 x 2 x 16
        assert received > 0 and received % (2 * 2 * 16 * 2 * 16) == 0
        assert_nothing_leaks(stack)


def test_a_worker_with_another_kv_dtype_is_refused_at_registration(registry):
    info = WorkerInfo("d0", "decode", "127.0.0.1:1", block_size=16, kv_dtype="float8_e4m3fn")
    registry.register_worker(info, ttl_s=10)
    other = WorkerInfo("p0", "prefill", "127.0.0.1:2", block_size=16, kv_dtype="bfloat16")
    with pytest.raises(BlockSizeMismatch, match="holds KV as bfloat16.*use one --kv-cache-dtype"):
        registry.register_worker(other, ttl_s=10)
    same = WorkerInfo("p1", "prefill", "127.0.0.1:3", block_size=16, kv_dtype="float8_e4m3fn")
    registry.register_worker(same, ttl_s=10)
