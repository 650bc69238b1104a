"""The decode benchmarks time a whole batch: with chunked prefill the first sequences decode
while the rest prefill, so a batch that takes many steps to fill must not run out of tokens
before it is timed (bench.common.decode_room), and a smaller batch is never reported as it."""

from __future__ import annotations

import pytest
import torch

from bench.common import check_whole_batch
from bench.decode_roofline import decode_step_times
from splitserve.engine import LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_models):
    # NOTE: 32-token steps: a batch of 16 prompts of 40 tokens takes 20 steps to fill
    config = EngineConfig(
        dtype=torch.float32,
        device="cpu",
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        enable_prefix_caching=False,
    )
    return LLMEngine(tiny_models["llama"], config)


def test_a_batch_that_takes_many_steps_to_fill_is_timed_whole(engine) -> None:
    times, mean_tokens, _ = decode_step_times(engine, batch=16, context=40, steps=5)
    assert len(times) == 5 and all(t > 0 for t in times)
    # the first rows decoded while the rest prefilled: longer than the prompt, within the model
    assert 40 < mean_tokens < 128
    assert not engine.has_unfinished_requests()  # idle for the next batch


def test_a_batch_that_lost_rows_is_refused(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(4):
        engine.add_request([5 + i, 6, 7, 8], params)
    for _ in range(4):
        engine.step()
    with pytest.raises(SystemExit, match="only 0 sequences ran"):
        check_whole_batch(engine, 4)
    while engine.has_unfinished_requests():
        engine.step()
