"""Reservations of an engine that keeps sliding layers' KV in a window pool (a tiny Gemma 3,
window 16 = one block): a stream handed off mid-way (parked, its blocks' full layers and the
window slots the destination gave copied over, admitted with the KV present) goes on exactly
as the first engine would have, moving the sliding layers of the blocks the first query sees
only; a reservation computed where it is (no KV came) starts afresh and matches too; and a
sender that holds no slot where the receiver reads one refuses to send."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.outputs import CompletionOutput, Resume
from splitserve.kv_transfer.transport import TransferError, window_pairs
from tests.engine.hf_oracle import hf_greedy, random_prompts

CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _run(engine: LLMEngine, request_id: str) -> CompletionOutput:
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0]


def _copy(src: LLMEngine, dst: LLMEngine, blocks, slots) -> None:
    """Blocks (src ids, dst ids) and window slots (src, dst) through the connectors."""
    for (ids, to), read, write, region in (
        (blocks, src.kv_connector.read_blocks, dst.kv_connector.write_blocks, "tensor"),
        (slots, src.kv_connector.read_slots, dst.kv_connector.write_slots, "window"),
    ):
        if not ids:
            continue
        pool = src.kv_connector.region().tensor
        if region == "window":
            window = src.kv_connector.region().window
            assert window is not None
            pool = window.tensor
        data = torch.empty((len(ids), *pool.shape[1:]), dtype=pool.dtype)
        write(list(to), read(list(ids), data))


def _free(engine: LLMEngine) -> bool:
    engine.block_manager.check_integrity()
    s = engine.stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_requests == 0


def test_a_handed_off_stream_moves_its_window_slots_only_and_goes_on_as_before(tiny_families):
    model = tiny_families["gemma3"]
    first, second = (LLMEngine(model, CONFIG) for _ in range(2))
    assert first.kv_cache.window_pool is not None, "the engine keeps no window pool"
    prompt = random_prompts([150], 500, seed=7)[0]
    first.add_request(prompt, GREEDY, "whole")
    whole = _run(first, "whole")
    assert list(whole.token_ids) == hf_greedy(model, tuple(prompt), GREEDY.max_tokens)
    first.add_request(prompt, GREEDY, "moving")
    made: list[int] = []
    for _ in range(9):
        for out in first.step():
            made = list(out.outputs[0].token_ids)
    assert first.park("moving") is not None
    res = second.reserve("resumed", prompt, GREEDY, Resume(0, tuple(made)))
    num_tokens = len(prompt) + len(made) - 1
    # The destination gave slots to the blocks its first query (at num_tokens) sees only.
    live = max(0, (num_tokens - 16 + 1) // 16)
    assert [i for i, s in enumerate(res.window_slots) if s] == list(range(live, len(res.block_ids)))
    first_block = res.num_cached_tokens // 16
    window_from = next(i for i, s in enumerate(res.window_slots) if s and i >= first_block)
    parked = first.take_parked_kv("moving", num_tokens, window_from)
    n = len(parked.block_ids)
    src_slots, dst_slots = window_pairs(
        parked.window_slots[first_block:], res.window_slots[first_block:n], n - first_block
    )
    assert len(dst_slots) == n - max(first_block, live) < n - first_block
    blocks = (parked.block_ids[first_block:], res.block_ids[first_block:n])
    _copy(first, second, blocks, (src_slots, dst_slots))
    first.unpin_blocks(parked.block_ids, parked.window_slots)
    prefilled = second.stats().num_prefill_tokens
    second.admit("resumed", GREEDY, None, kv_present=True)
    resumed = _run(second, "resumed")
    assert resumed.token_ids == whole.token_ids
    # The sliding layers read the slots moved: the next tokens' log-probabilities are the first
    # engine's (the tiny model's greedy margins alone would hide a window read as zeros).
    for got, want in zip(resumed.logprobs[len(made) :], whole.logprobs[len(made) :], strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-4 for t in got), (got, want)
    assert second.stats().num_prefill_tokens == prefilled  # nothing recomputed
    assert _free(first) and _free(second)


def test_a_reservation_computed_in_place_starts_afresh_and_matches_hf(tiny_families):
    model = tiny_families["gemma3"]
    engine = LLMEngine(model, CONFIG)
    prompt = random_prompts([150], 500, seed=9)[0]
    res = engine.reserve("r", prompt, GREEDY)
    assert res.window_slots and not res.window_slots[0]  # early blocks: no slot
    engine.admit("r", GREEDY, None)  # no first tokens: prefilled here
    out = _run(engine, "r")
    assert list(out.token_ids) == hf_greedy(model, tuple(prompt), GREEDY.max_tokens)
    assert _free(engine)


def test_a_sender_without_the_slot_the_receiver_reads_refuses() -> None:
    assert window_pairs((), (), 3) == ((), ())
    assert window_pairs((0, 5, 6), (0, 2, 3), 3) == ((5, 6), (2, 3))
    with pytest.raises(TransferError, match="holds no window slot") as err:
        window_pairs((0, 0, 6), (0, 2, 3), 3)
    assert err.value.status == "FAILED_PRECONDITION"
