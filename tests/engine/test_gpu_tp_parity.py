"""On two GPUs (NCCL): a TP=2 engine in float32 gives HF's greedy tokens, eager and with its
decode CUDA graphs (the NCCL collectives captured inside them, `tensor_parallel_cuda_graphs`),
each with the small all-reduces over NCCL and over peer memory
(`tensor_parallel_peer_all_reduce_bytes`), and its KV pools and follower ranks are released when
it stops (every rank exits 0). Skipped with fewer than two GPUs (CI has none); on a GPU host:
`bash bench/device.sh tensor-parallel-parity`."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.testing.tiny_model import make_tiny_model
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.mark.parametrize(
    ("graphs", "peer"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["eager", "graphs", "eager-peer", "graphs-peer"],
)
def test_gpu_tp2_float32_greedy_tokens_match_hf(tmp_path, graphs, peer):
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cuda:0",
        tensor_parallel_size=2,
        tensor_parallel_cuda_graphs=graphs,
        tensor_parallel_peer_all_reduce_bytes=(64 << 20) if peer else 0,
        num_kv_blocks=256,
        max_num_seqs=8,
    )
    followers = llm.engine.followers
    assert followers is not None
    try:
        assert (llm.engine.runner.graphs is not None) == graphs
        assert followers.group is not None and followers.group.peer_all_reduce == peer
        prompts = random_prompts([5, 30, 70], llm.engine.model_config.vocab_size, seed=2)
        lengths = [16, 9, 24]  # staggered stops: the batch runs buckets 4, then 2, then 1
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        want = [hf_greedy(model_dir, tuple(p), n) for p, n in zip(prompts, lengths, strict=True)]
        print(f"\nTP=2 graphs={graphs} peer={peer}: HF's tokens {got == want}")
        assert got == want
        assert llm.engine.kv_usage().num_used_blocks == 0
    finally:
        llm.engine.shutdown()
    assert [p.returncode for p in followers.procs] == [0]
