"""On two GPUs (NCCL): a TP=2 engine in float32 gives HF's greedy tokens, eager and with its
decode CUDA graphs (the NCCL collectives captured inside them, `tensor_parallel_cuda_graphs`),
each with the small all-reduces over NCCL and over peer memory
(`tensor_parallel_peer_all_reduce_bytes`), and its KV pools and follower ranks are released when
it stops (every rank exits 0). Each case's engine runs in a fresh process: PyTorch pairs peer-
memory set-ups by their order in each process, so a second one in this process would meet new
followers at a different count (that case falls back to NCCL: tests/unit/test_peer_setups.py).
Skipped with fewer than two GPUs (CI has none); on a GPU host:
`bash bench/device.sh tensor-parallel-parity`."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from splitserve.testing.tiny_model import make_tiny_model
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

LENGTHS = [16, 9, 24]  # staggered stops: the batch runs buckets 4, then 2, then 1


def _case(model_dir: Path, prompts: list[list[int]], graphs: bool, peer: bool) -> dict:
    from splitserve.engine import LLM, SamplingParams

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
    assert followers is not None and followers.group is not None
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
        outs = llm.generate(prompts, params, use_tqdm=False)
        result = {
            "graphs": llm.engine.runner.graphs is not None,
            "peer": followers.group.peer_all_reduce,
            "tokens": [o.outputs[0].token_ids for o in outs],
            "used_blocks": llm.engine.kv_usage().num_used_blocks,
        }
    finally:
        llm.engine.shutdown()
    result["follower_codes"] = [p.returncode for p in followers.procs]
    return result


@pytest.mark.parametrize(
    ("graphs", "peer"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["eager", "graphs", "eager-peer", "graphs-peer"],
)
def test_gpu_tp2_float32_greedy_tokens_match_hf(tmp_path, graphs, peer):
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts([5, 30, 70], vocab, seed=2)
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_case, (model_dir, prompts, graphs, peer))
    want = [hf_greedy(model_dir, tuple(p), n) for p, n in zip(prompts, LENGTHS, strict=True)]
    print(f"\nTP=2 graphs={graphs} peer={peer}: HF's tokens {got['tokens'] == want}")
    assert got["graphs"] == graphs
    assert got["peer"] == peer
    assert got["tokens"] == want
    assert got["used_blocks"] == 0
    assert got["follower_codes"] == [0]
