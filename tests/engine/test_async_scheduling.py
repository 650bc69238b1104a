"""Overlapped decode steps (engine/overlap.py) give the tokens HF gives, whatever joins, stops,
is preempted or aborted while a step is in flight. On the CPU the mechanism is the same (tokens
carried on the device, placeholders, settling one call later); only the overlap is not."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.overlap import PLACEHOLDER
from tests.engine.hf_oracle import hf_greedy, random_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _count_launches(engine: LLMEngine) -> list[int]:
    launches = [0]
    original = engine.runner.launch

    def spy(*args, **kwargs):
        launches[0] += 1
        return original(*args, **kwargs)

    engine.runner.launch = spy
    return launches


def _assert_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    usage = engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_sequences == 0


def _assert_greedy_matches_hf(model_dir, prompts, outputs, max_new=MAX_NEW) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        assert PLACEHOLDER not in tokens
        assert tokens == hf_greedy(model_dir, tuple(prompt), max_new), len(prompt)
        assert out.outputs[0].finish_reason == "length"


def test_off_by_default_on_the_cpu(tiny_models):
    assert not LLMEngine(tiny_models["llama"]).overlap
    assert LLMEngine(tiny_models["llama"], EngineConfig(async_scheduling=True)).overlap


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_overlapped_batch_matches_hf(tiny_models, arch):
    llm = LLM(tiny_models[arch], async_scheduling=True, max_num_batched_tokens=64)
    launches = _count_launches(llm.engine)
    prompts = random_prompts([1, 5, 16, 17, 40, 97, 33], llm.engine.model_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_greedy_matches_hf(tiny_models[arch], prompts, outputs)
    assert launches[0] >= MAX_NEW - 2, "decode steps did not overlap"
    _assert_clean(llm.engine)


def test_preemption_while_in_flight_matches_hf(tiny_models):
    # 40 blocks of 16 slots cannot hold the batch with its outputs: sequences are preempted
    # in the scheduling pass that runs while a step is in flight.
    model = tiny_models["llama"]
    llm = LLM(model, async_scheduling=True, num_kv_blocks=40, enable_prefix_caching=False)
    prompts = random_prompts([30, 120, 200, 90, 60, 150], llm.engine.model_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_greedy_matches_hf(model, prompts, outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_clean(llm.engine)


def test_blocks_filled_by_overlapped_steps_are_cached_by_their_real_tokens(tiny_models):
    # The first request's decode fills blocks 2..3 while steps are in flight; a second prompt
    # that repeats its prompt and output must hit them and still give HF's tokens.
    model = tiny_models["qwen3"]
    llm = LLM(model, async_scheduling=True)
    first = random_prompts([20], llm.engine.model_config.vocab_size, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    generated = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
    second = first + generated[:30] + [7]
    out = llm.generate([second], GREEDY, use_tqdm=False)
    _assert_greedy_matches_hf(model, [second], out)
    assert out[0].num_cached_tokens == 48  # three full blocks, two of them from decode steps


def test_stops_and_mixed_sampling_match_the_synchronous_engine(tiny_models):
    # Greedy rows with stop tokens and min_tokens, seeded random rows and logprobs share the
    # batch: steps switch between overlapped and synchronous. Each request's tokens must be
    # what the synchronous engine gives (seeded draws do not depend on the batch), and the
    # greedy ones what HF gives.
    model = tiny_models["llama"]
    vocab = LLMEngine(model).model_config.vocab_size
    prompts = random_prompts([9, 23, 4, 31, 15, 40], vocab, seed=5)
    reference = hf_greedy(model, tuple(prompts[0]), MAX_NEW)
    stop = reference[6]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=MAX_NEW, seed=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=8, stop_token_ids=[3]),
        GREEDY,
    ]
    runs = {}
    for overlap in (False, True):
        engine = LLMEngine(model, EngineConfig(async_scheduling=overlap))
        launches = _count_launches(engine)
        finished = {}
        for step in range(200):
            if step < len(prompts):  # one request joins per step
                engine.add_request(prompts[step], params[step], request_id=str(step))
            for out in engine.step():
                if out.finished:
                    finished[int(out.request_id)] = out.outputs[0]
            if step >= len(prompts) and not engine.has_unfinished_requests():
                break
        runs[overlap] = [finished[i] for i in range(len(prompts))]
        assert (launches[0] > 0) == overlap
        _assert_clean(engine)
    for sync, overlapped in zip(runs[False], runs[True], strict=True):
        assert overlapped.token_ids == sync.token_ids
        assert (overlapped.finish_reason, overlapped.stop_reason) == (
            sync.finish_reason,
            sync.stop_reason,
        )
        assert overlapped.logprobs == sync.logprobs
    first = runs[True][0]
    assert first.token_ids == reference[: reference.index(stop) + 1]
    assert first.stop_reason == stop
    assert runs[True][2].token_ids == hf_greedy(model, tuple(prompts[2]), 5)


def test_abort_while_in_flight_frees_everything_and_others_go_on(tiny_models):
    model = tiny_models["llama"]
    engine = LLMEngine(model, EngineConfig(async_scheduling=True))
    prompts = random_prompts([12, 30, 7], engine.model_config.vocab_size, seed=9)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=str(i))
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    assert engine.abort_request("1")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "1"
            if out.finished:
                finished[out.request_id] = out
    _assert_greedy_matches_hf(model, [prompts[0], prompts[2]], [finished["0"], finished["2"]])
    _assert_clean(engine)
    # A request reusing the aborted id starts clean: no token of the old one is carried over.
    engine.add_request(prompts[1][:1], GREEDY, request_id="1")
    done = []
    while engine.has_unfinished_requests():
        done += [out for out in engine.step() if out.finished]
    _assert_greedy_matches_hf(model, [prompts[1][:1]], done)
    _assert_clean(engine)


@pytest.mark.parametrize(("value", "want"), [(None, None), ("on", True), ("off", False)])
def test_the_worker_flag_reaches_the_engine_config(value, want):
    """`--async-scheduling` / SPLITSERVE_ASYNC_SCHEDULING: auto leaves it to the engine (on with
    CUDA graphs); anything but auto, on or off is refused."""
    from splitserve.cli import build_parser
    from splitserve.launch.workers import engine_config
    from splitserve.runtime.settings import WorkerSettings, from_args

    env = {} if value is None else {"SPLITSERVE_ASYNC_SCHEDULING": value}
    args = build_parser(env).parse_args(["decode", "--redis-url", "redis://x"])
    assert engine_config(from_args(WorkerSettings, args)).async_scheduling is want
    args = build_parser({}).parse_args(
        ["prefill", "--redis-url", "redis://x", "--async-scheduling", "maybe"]
    )
    with pytest.raises(ValueError, match="--async-scheduling must be one of auto, on, off"):
        engine_config(from_args(WorkerSettings, args))
