"""What each tensor-parallel rank holds of a checkpoint, and the step plan's wire form."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel import sharding
from splitserve.engine.parallel.sharding import Shard
from splitserve.engine.parallel.step_plan import StepPlan, decode, encode

CPU = torch.device("cpu")


def _cfg(**over) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 11,
        "hidden_size": 8,
        "intermediate_size": 6,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return ModelConfig.from_hf_dict({**raw, **over})


def test_kv_heads_split_across_ranks_or_replicated_when_fewer():
    assert [sharding.kv_head_range(4, Shard(r, 2)) for r in range(2)] == [(0, 2), (2, 4)]
    # 1 KV head, 2 ranks: both hold head 0; 2 KV heads, 4 ranks: ranks 0-1 head 0, 2-3 head 1.
    assert [sharding.kv_head_range(1, Shard(r, 2)) for r in range(2)] == [(0, 1), (0, 1)]
    assert [sharding.kv_head_range(2, Shard(r, 4))[0] for r in range(4)] == [0, 0, 1, 1]


def test_local_config_holds_this_ranks_heads_and_mlp_columns_and_the_whole_vocab():
    local = sharding.local_config(_cfg(), Shard(1, 2))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 3)
    assert (local.vocab_size, local.head_dim) == (11, 2)


def test_a_degree_that_does_not_divide_the_model_names_the_field():
    with pytest.raises(ValueError, match="intermediate_size"):
        sharding.check_divisible(_cfg(intermediate_size=7), 2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        sharding.check_divisible(_cfg(num_attention_heads=6, num_key_value_heads=3), 2)


def test_each_rank_reads_its_slices_and_they_tile_the_checkpoint(tmp_path):
    cfg = _cfg()
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 6),
        "model.embed_tokens.weight": torch.randn(11, 8),
        "model.norm.weight": torch.randn(8),
    }
    save_file(full, tmp_path / "w.safetensors")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in full}
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for rank in range(2):
            for name in full:
                part = sharding.read_slice(name, f.get_slice(name), cfg, Shard(rank, 2))
                parts[name].append(part)
    cat = torch.cat
    q, k, o, down, embed, norm = (parts[n] for n in full)
    assert torch.equal(cat(q), full["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(cat(k), full["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(cat(o, dim=1), full["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(cat(down, dim=1), full["model.layers.0.mlp.down_proj.weight"])
    # 11 rows over 2 ranks: 6 each, the last rank's sixth a zero pad row.
    assert [p.shape[0] for p in embed] == [6, 6] and not embed[1][-1].any()
    assert torch.equal(cat(embed)[:11], full["model.embed_tokens.weight"])
    assert all(torch.equal(p, full["model.norm.weight"]) for p in norm)


def test_step_plan_round_trips_through_its_int_encoding():
    plan = StepPlan(
        block_copies=((3, 9),),
        input_ids=[5, 6, 7, 8],
        positions=[0, 1, 2, 40],
        slots=[16, 17, 18, 72],
        query_lens=[3, 1],
        seq_lens=[3, 41],
        tables=[[1], [2, 3, 4]],
        logits_indices=[2, 3],
    )
    header, payload = encode(plan)
    assert all(isinstance(v, int) for v in header + payload)
    assert decode(header, payload) == plan


def _idle_rank(rank: int, port: int, out) -> None:
    from splitserve.engine.parallel.group import Rendezvous, TorchGroup
    from splitserve.engine.parallel.step_plan import StepPlanChannel

    rendezvous = Rendezvous("127.0.0.1", port, timeout_s=1.0, join_timeout_s=120.0)
    group = TorchGroup(Shard(rank, 2), rendezvous, CPU)
    channel = StepPlanChannel(group, CPU)
    if rank == 0:
        time.sleep(3.0)  # idle for three times the group's timeout
        channel.send(StepPlan(input_ids=[1, 2], positions=[0, 1], slots=[0, 1], query_lens=[2],
                              seq_lens=[2], tables=[[0]], logits_indices=[1]))  # fmt: skip
        channel.send_stop()
    else:
        out.put(channel.recv())
        out.put(channel.recv())
    group.close()


def test_a_follower_waits_out_an_idle_rank_0_longer_than_the_group_timeout():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    follower = ctx.Process(target=_idle_rank, args=(1, port, out))
    follower.start()
    _idle_rank(0, port, out)
    plan, stop = out.get(timeout=30), out.get(timeout=30)
    follower.join(30)
    assert plan.input_ids == [1, 2] and plan.tables == [[0]] and stop is None
