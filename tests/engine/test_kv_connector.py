"""The engine's KV connector: a watched prefill reports each block once, in prompt order, as
chunks finish; reported blocks stay pinned through preemption and abort until released; the
bytes read out of pinned blocks are the KV the engine computed; and a decode engine admits a
request whose blocks were written through the connector with the same tokens as HF."""

from __future__ import annotations

import queue

import pytest
import torch

from splitserve.engine import LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.errors import Cancelled
from splitserve.engine.kv_connector import KVOutbox, ReadyBlocks
from splitserve.engine.outputs import SampledToken
from tests.engine.hf_oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(model, **kw) -> LLMEngine:
    kw.setdefault("block_size", 16)
    return LLMEngine(model, EngineConfig(**kw))


def _watch(engine: LLMEngine, prompt: list[int], rid: str, first: int = 0) -> KVOutbox:
    engine.add_request(prompt, GREEDY, rid, prefill_only=True)
    return engine.kv_connector.watch(rid, first)


def _drain(outbox: KVOutbox) -> list[ReadyBlocks]:
    batches = []
    while True:
        try:
            batches.append(outbox.get(timeout_s=0))
        except queue.Empty:
            return batches


def _free(engine: LLMEngine) -> int:
    return engine.stats().num_free_blocks


def test_chunked_prefill_reports_each_block_once_in_order_and_pins_it(tiny_models):
    engine = _engine(tiny_models["llama"], max_num_batched_tokens=40)
    prompt = random_prompts([100], engine.model_config.vocab_size, seed=1)[0]  # 7 blocks
    outbox = _watch(engine, prompt, "r", first=1)  # block 0 is cached on the receiver
    batches: list[ReadyBlocks] = []
    while engine.has_unfinished_requests():
        engine.step()
        batches += _drain(outbox)
    assert [b.first_index for b in batches] == [1, 2, 5]  # 40, 80, 100 tokens computed
    indices = [b.first_index + i for b in batches for i in range(len(b.block_ids))]
    assert indices == list(range(1, 7))
    assert [b.is_last for b in batches] == [False, False, True]
    assert batches[-1].num_tokens == 100
    pinned = [block for b in batches for block in b.block_ids]
    assert engine.stats().num_pinned_blocks == 6
    assert engine.has_request("r"), "step hooks still see the finished prefill after its step"
    engine.housekeeping()
    assert not engine.has_request("r"), "then it is forgotten: its KV is pinned"
    engine.kv_connector.release("r", pinned[:3])
    engine.housekeeping()
    assert engine.stats().num_pinned_blocks == 3
    engine.kv_connector.unwatch("r")
    engine.housekeeping()
    assert engine.stats().num_pinned_blocks == 0
    assert _free(engine) == engine.stats().num_total_blocks
    engine.block_manager.check_integrity()


def test_pinned_blocks_survive_an_abort_until_unwatched(tiny_models):
    engine = _engine(tiny_models["llama"], max_num_batched_tokens=32)
    total = engine.stats().num_total_blocks
    prompt = random_prompts([90], engine.model_config.vocab_size, seed=2)[0]
    outbox = _watch(engine, prompt, "r")
    engine.step()
    (first,) = _drain(outbox)
    assert len(first.block_ids) == 2
    assert engine.abort_request("r")
    with pytest.raises(Cancelled):
        outbox.get(timeout_s=0)
    assert _free(engine) == total - 2, "the two pinned blocks are still held"
    engine.block_manager.check_integrity()
    engine.kv_connector.unwatch("r")
    engine.housekeeping()
    assert _free(engine) == total


def test_read_blocks_returns_the_kv_the_engine_computed(tiny_models):
    engine = _engine(tiny_models["qwen3"], max_num_batched_tokens=512)
    prompt = random_prompts([50], engine.model_config.vocab_size, seed=3)[0]
    outbox = _watch(engine, prompt, "r")
    engine.step()
    (batch,) = _drain(outbox)
    region = engine.kv_connector.region()
    out = torch.empty((len(batch.block_ids), *region.tensor.shape[1:]), dtype=region.dtype)
    engine.kv_connector.read_blocks(batch.block_ids, out, batch)
    assert torch.equal(out, region.tensor[list(batch.block_ids)].cpu())
    assert out[:, :, :, : 50 - 48].abs().sum() > 0  # real keys and values, every layer
    assert region.block_bytes == out[0].numel() * out.element_size()


def _prefill_elsewhere(
    prefill: LLMEngine, prompt: list[int], rid: str
) -> tuple[list[SampledToken], torch.Tensor]:
    """Prefill `prompt` on `prefill` as a prefill worker does: its first token and the KV of
    all its blocks, read out of the pool through the connector."""
    outbox = _watch(prefill, prompt, rid)
    first: list[SampledToken] = []
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first = [SampledToken(t) for t in out.outputs[0].token_ids]
    (batch,) = _drain(outbox)
    region = prefill.kv_connector.region()
    data = torch.empty((len(batch.block_ids), *region.tensor.shape[1:]), dtype=region.dtype)
    prefill.kv_connector.read_blocks(batch.block_ids, data, batch)
    prefill.kv_connector.unwatch(rid)
    return first, data


def test_blocks_written_through_the_connector_decode_like_hf(tiny_models):
    model = tiny_models["llama"]
    prefill = _engine(model)
    decode = _engine(model)
    prompt = random_prompts([45], prefill.model_config.vocab_size, seed=4)[0]
    first, data = _prefill_elsewhere(prefill, prompt, "r")
    reservation = decode.reserve("r", prompt, GREEDY)
    decode.kv_connector.write_blocks(reservation.block_ids, data)
    outputs = decode.admit("r", GREEDY, first)
    while decode.has_unfinished_requests():
        outputs = decode.step()
    assert outputs[-1].outputs[0].token_ids == hf_greedy(model, tuple(prompt), 8)


def test_prefilled_requests_queue_for_a_batch_slot_and_decode_like_hf(tiny_models):
    model = tiny_models["llama"]
    prefill = _engine(model)
    decode = _engine(model, max_num_seqs=2)
    prompts = random_prompts([20, 33, 47], prefill.model_config.vocab_size, seed=6)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        first, data = _prefill_elsewhere(prefill, prompt, rid)
        decode.kv_connector.write_blocks(decode.reserve(rid, prompt, GREEDY).block_ids, data)
        decode.admit(rid, GREEDY, first)
    stats = decode.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 3)
    decode.step()
    assert (decode.stats().num_requests_running, decode.stats().num_requests_waiting) == (2, 1)
    done = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(model, tuple(prompt), 8)
    assert decode.stats().num_free_blocks == decode.stats().num_total_blocks
