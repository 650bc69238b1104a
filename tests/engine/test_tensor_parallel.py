"""Tensor parallelism on the CPU (gloo, real follower processes): greedy float32 tokens equal
TP=1's and HF's for every tiny architecture, a dead rank fails the engine with a clear error,
and shutdown stops every rank."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.outputs import SampledToken
from splitserve.engine.parallel.launcher import RankLost
from splitserve.testing.tiny_model import make_tiny_model
from tests.engine.hf_oracle import hf_greedy, random_prompts

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = [1, 17, 97]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def replicated_kv_model(tmp_path_factory):
    """Fewer KV heads (1) than ranks (2): both ranks hold the one KV head."""
    root = tmp_path_factory.mktemp("tp-models")
    return make_tiny_model(root / "llama-kv1", "llama", config_overrides={"num_key_value_heads": 1})


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "llama-kv1"])
def test_tp2_greedy_tokens_equal_tp1_and_hf(tiny_models, replicated_kv_model, arch):
    model_dir = replicated_kv_model if arch == "llama-kv1" else tiny_models[arch]
    # A small token budget chunks the long prompts; a shared prefix hits the prefix cache.
    options = {"num_kv_blocks": 64, "max_num_batched_tokens": 32}
    tp2 = LLM(model_dir, tensor_parallel_size=2, **options)
    try:
        vocab = tp2.engine.model_config.vocab_size
        prompts = random_prompts(LENGTHS, vocab)
        prompts.append(prompts[-1][:80] + [5, 6, 7])  # 5 blocks of it cached
        got = _tokens(tp2, prompts)
        tp2.engine.check_integrity()
        assert tp2.engine.kv_usage().num_used_blocks == 0
    finally:
        tp2.engine.shutdown()
    want_tp1 = _tokens(LLM(model_dir, **options), prompts)
    want_hf = [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    assert got == want_tp1
    assert got == want_hf


@pytest.mark.slow
def test_dead_rank_fails_the_engine_and_shutdown_stops_every_rank(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, num_kv_blocks=32)
    engine = llm.engine
    assert engine.followers is not None
    try:
        assert len(_tokens(llm, [[3, 4, 5]])[0]) == MAX_NEW
        (proc,) = engine.followers.procs
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with pytest.raises(RankLost, match="rank 1 .* exited"):
            llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.followers.procs)


@pytest.mark.slow
def test_shutdown_stops_every_rank_cleanly(tiny_models):
    llm = LLM(tiny_models["qwen2"], tensor_parallel_size=2, num_kv_blocks=32)
    followers = llm.engine.followers
    assert followers is not None
    llm.engine.shutdown()
    assert [p.returncode for p in followers.procs] == [0]


def test_a_degree_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tiny_models):
    # The tiny Llama has 4 query heads and 2 KV heads: 3 ranks can't split them.
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        LLM(tiny_models["llama"], tensor_parallel_size=3)


def _on_engine_thread(engine: LLMEngine, fn: Callable[[], None]) -> None:
    """Run `fn` (a transport's call) on another thread while this one turns the engine's loop,
    as a worker's transport and engine threads do."""
    worker = threading.Thread(target=fn)
    worker.start()
    while worker.is_alive():
        engine.housekeeping()
        worker.join(0.01)


def _wire_blocks(engine: LLMEngine, num_blocks: int) -> torch.Tensor:
    region = engine.kv_connector.region()
    shape = (region.num_layers, 2, region.block_size, region.num_kv_heads, region.head_dim)
    assert region.block_bytes == math.prod(shape) * region.tensor.element_size()
    return torch.empty((num_blocks, *shape), dtype=region.dtype)


@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_moves_between_degrees_and_decodes_like_hf(tiny_models, prefill_tp, decode_tp):
    """The connector hands transports whole-head blocks whatever the degree: a prefill at TP=a
    and a decode at TP=b exchange them and decode HF's tokens."""
    model = tiny_models["llama"]
    prefill = LLMEngine(model, EngineConfig(tensor_parallel_size=prefill_tp, num_kv_blocks=32))
    decode = LLMEngine(model, EngineConfig(tensor_parallel_size=decode_tp, num_kv_blocks=32))
    try:
        prompt = random_prompts([45], prefill.model_config.vocab_size, seed=4)[0]
        prefill.add_request(prompt, GREEDY, "r", prefill_only=True)
        outbox = prefill.kv_connector.watch("r", 0)
        first: list[SampledToken] = []
        while prefill.has_unfinished_requests():
            for out in prefill.step():
                first = [SampledToken(t) for t in out.outputs[0].token_ids]
        batch = outbox.get(timeout_s=0)
        assert batch.is_last
        data = _wire_blocks(prefill, len(batch.block_ids))
        _on_engine_thread(
            prefill, lambda: prefill.kv_connector.read_blocks(batch.block_ids, data, batch)
        )
        prefill.kv_connector.unwatch("r")
        prefill.housekeeping()
        reservation = decode.reserve("r", prompt, GREEDY)
        _on_engine_thread(
            decode, lambda: decode.kv_connector.write_blocks(reservation.block_ids, data)
        )
        outputs = decode.admit("r", GREEDY, first)
        while decode.has_unfinished_requests():
            outputs = decode.step()
        assert outputs[-1].outputs[0].token_ids == hf_greedy(model, tuple(prompt), MAX_NEW)
        for engine in (prefill, decode):
            stats = engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
            assert stats.num_pinned_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.slow
def test_ngram_speculation_at_tp2_verifies_drafts_and_gives_hf_tokens(tiny_models):
    """Proposals are made on rank 0; their verification is a step like any other."""
    from splitserve.engine.spec_decode.config import SpeculativeConfig

    model = tiny_models["llama"]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    llm = LLM(model, tensor_parallel_size=2, num_kv_blocks=64, speculative=spec)
    try:
        prompts = [*random_prompts([5, 40], 500), [7, 8, 9, 10] * 10]
        got = _tokens(llm, prompts)
        assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(model, tuple(p), MAX_NEW) for p in prompts]


RANK0_SCRIPT = """
import sys, time
from splitserve.engine import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=16)
print(*llm.engine.followers.pids(), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_followers_exit_when_rank_0_is_killed(tiny_models):
    """No follower outlives its rank 0 (it would hold a GPU): SIGKILL of the process that hosts
    the engine takes its followers down within seconds."""
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0_SCRIPT, str(tiny_models["llama"])], stdout=subprocess.PIPE
    )
    try:
        assert rank0.stdout is not None
        (follower,) = (int(pid) for pid in rank0.stdout.readline().split())
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(10)
        deadline = time.monotonic() + 15
        while _alive(follower):
            assert time.monotonic() < deadline, "the follower outlived rank 0"
            time.sleep(0.1)
    finally:
        rank0.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its parent, gone, can't reap it at once)
