"""A fuzz of hostile requests mixed with valid ones on a real stack (2 prefill + 2 decode
workers, real redis-server): unbounded n, huge / CRLF / non-ASCII / duplicate ids, huge stop
strings, token ids out of the vocabulary, NaN / inf / negative floats, huge max_tokens.

No call hangs, no worker crashes, every refusal is INVALID_ARGUMENT with a message under 1 KiB
(ALREADY_EXISTS for an id that is running: a valid request at the wrong moment), and every
valid request's tokens are the offline engine's."""

from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, gateway_pb2
from tests.e2e.harness import assert_nothing_leaks, gateway, workers

pytestmark = pytest.mark.slow

NUM_REQUESTS = 2000
BATCH = 64
CALL_TIMEOUT_S = 30.0
VOCAB = 512  # the tiny llama's
MAX_MODEL_LEN = 2048
U32 = 2**32 - 1
NAN, INF = float("nan"), float("inf")


@dataclass
class Case:
    request: gateway_pb2.GenerateRequest
    kind: str  # what is wrong with it, or "valid" / "duplicate"
    params: SamplingParams | None = None  # valid ones: what the offline engine runs
    prompt: list[int] = field(default_factory=list)


def _sampling(**fields) -> common_pb2.SamplingParams:
    stop = fields.pop("stop", ())
    stop_ids = fields.pop("stop_token_ids", ())
    msg = common_pb2.SamplingParams(stop=list(stop), stop_token_ids=list(stop_ids))
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


def _request(rid: str, prompt: list[int] | None, sampling: common_pb2.SamplingParams, text=None):
    request = gateway_pb2.GenerateRequest(request_id=rid, sampling=sampling)
    if text is not None:
        request.text = text
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    return request


# What is wrong with each hostile request: a name and the fields it breaks.
HOSTILE = {
    "n_huge": lambda r: {"n": r.choice([257, 10**6, U32])},
    "max_tokens_huge": lambda r: {"max_tokens": r.choice([MAX_MODEL_LEN, 10**9, U32])},
    "max_tokens_zero": lambda r: {"max_tokens": 0},
    "min_tokens_over": lambda r: {"max_tokens": 2, "min_tokens": 3},
    "temperature": lambda r: {"temperature": r.choice([NAN, INF, -INF, -1.0])},
    "top_p": lambda r: {"top_p": r.choice([NAN, 0.0, 1.5, -INF])},
    "min_p": lambda r: {"min_p": r.choice([NAN, -0.5, 2.0])},
    "top_k": lambda r: {"top_k": r.choice([-2, -(2**31)])},
    "repetition_penalty": lambda r: {"repetition_penalty": r.choice([NAN, 0.0, -1.0, INF])},
    "presence_penalty": lambda r: {"presence_penalty": r.choice([NAN, 3.0, -INF])},
    "frequency_penalty": lambda r: {"frequency_penalty": r.choice([NAN, -3.0, INF])},
    "logprobs": lambda r: {"logprobs": r.choice([21, U32])},
    "stop_huge": lambda r: {"stop": ["x" * r.choice([257, 100_000])]},
    "stop_many": lambda r: {"stop": [f"s{i}" for i in range(r.choice([17, 5000]))]},
    "stop_empty": lambda r: {"stop": ["ok", ""]},
    "stop_ids_out_of_vocab": lambda r: {"stop_token_ids": [r.choice([VOCAB, 10**6, U32])]},
    "stop_ids_many": lambda r: {"stop_token_ids": list(range(3, 3 + r.choice([257, 10_000])))},
}
HOSTILE_PROMPT = {
    "prompt_out_of_vocab": lambda r: [5, r.choice([VOCAB, 10**6, U32]), 6],
    "prompt_empty": lambda r: [],
    "prompt_too_long": lambda r: [7] * r.choice([MAX_MODEL_LEN, 50_000]),
}
HOSTILE_ID = {
    "id_huge": lambda r: "i" * r.choice([257, 1_000_000]),
    "id_crlf": lambda r: "x\r\nERROR forged log line",
    "id_control": lambda r: "nul\x00id",
    "id_non_ascii": lambda r: "идентификатор",
}


def make_cases(seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 48))]
        valid = {
            "temperature": 0.0,
            "max_tokens": rng.randint(1, 4),
            "ignore_eos": True,
        }
        roll = rng.random()
        rid = f"fuzz-{i}"
        if roll < 0.08:  # valid, sometimes with extras the oracle applies too
            if rng.random() < 0.3:
                valid["n"] = 2
            if rng.random() < 0.3:
                valid["stop_token_ids"] = [rng.randint(3, VOCAB - 1)]
            if rng.random() < 0.2:
                rid = ""  # the gateway makes one
            params = convert.sampling_from_proto(_sampling(**valid))
            cases.append(Case(_request(rid, prompt, _sampling(**valid)), "valid", params, prompt))
        elif roll < 0.11:  # valid, with an id that other requests in its batch share
            params = convert.sampling_from_proto(_sampling(**valid))
            request = _request(f"shared-{i % 7}", prompt, _sampling(**valid))
            cases.append(Case(request, "duplicate", params, prompt))
        elif roll < 0.78:
            kind = rng.choice(sorted(HOSTILE))
            fields = {**valid, **HOSTILE[kind](rng)}
            cases.append(Case(_request(rid, prompt, _sampling(**fields)), kind))
        elif roll < 0.90:
            kind = rng.choice(sorted(HOSTILE_PROMPT))
            cases.append(Case(_request(rid, HOSTILE_PROMPT[kind](rng), _sampling(**valid)), kind))
        elif roll < 0.98:
            kind = rng.choice(sorted(HOSTILE_ID))
            cases.append(Case(_request(HOSTILE_ID[kind](rng), prompt, _sampling(**valid)), kind))
        else:
            cases.append(Case(_request(rid, None, _sampling(**valid), text=""), "prompt_missing"))
    return cases


def run_case(stub, case: Case) -> tuple[str, object]:
    """("OK", tokens per sample) or (status name, details); "HANG" if it outlived its deadline."""
    try:
        samples: dict[int, list[int]] = {}
        finished = None
        for msg in stub.Generate(case.request, timeout=CALL_TIMEOUT_S):
            if msg.HasField("chunk"):
                samples.setdefault(msg.chunk.index, []).extend(msg.chunk.token_ids)
            else:
                finished = msg.finished
        assert finished is not None, "the stream ended without its final message"
        return "OK", [samples.get(i, []) for i in range(len(finished.samples))]
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "HANG", err.details()
        return err.code().name, err.details() or ""


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


def test_a_fuzz_of_hostile_requests_loses_nothing(calm_stack, model_dir):
    stack = calm_stack
    cases = make_cases(seed=2026)
    expect_ok = [c for c in cases if c.params is not None]
    llm = LLM(model_dir)
    assert llm.engine.model_config.vocab_size == VOCAB
    outs = llm.generate(
        [c.prompt for c in expect_ok], [c.params for c in expect_ok], use_tqdm=False
    )
    expected = {
        id(c): [s.token_ids for s in o.outputs] for c, o in zip(expect_ok, outs, strict=True)
    }

    stub = gateway(stack)
    started = time.monotonic()
    results: list[tuple[Case, tuple[str, object]]] = []
    with ThreadPoolExecutor(32) as pool:
        for b in range(0, len(cases), BATCH):
            batch = cases[b : b + BATCH]
            done = pool.map(lambda c: (c, run_case(stub, c)), batch, timeout=CALL_TIMEOUT_S + 10)
            results.extend(done)
    elapsed = time.monotonic() - started

    outcome = Counter()
    for case, (status, detail) in results:
        outcome[(case.kind == "valid" or case.kind == "duplicate", status)] += 1
        assert status != "HANG", (case.kind, detail)
        if case.kind == "valid":
            assert status == "OK", (case.request.request_id, status, detail)
        elif case.kind == "duplicate":
            # Its id was running in another call of its batch: refused, touching nothing.
            assert status in ("OK", "ALREADY_EXISTS"), (status, detail)
        else:
            assert status == "INVALID_ARGUMENT", (case.kind, status, str(detail)[:300])
        if status == "OK":
            assert detail == expected[id(case)], case.request.request_id
        else:
            assert len(str(detail).encode()) < 1024, (case.kind, len(str(detail).encode()))
            assert "\r" not in str(detail) and "\n" not in str(detail)

    # Every process alive, every worker still registered, nothing held anywhere.
    assert all(p.poll() is None for p in stack.processes)
    assert sorted(w.kind for w in workers(stack)) == ["decode", "decode", "prefill", "prefill"]
    assert_nothing_leaks(stack)
    assert len(results) == NUM_REQUESTS >= 2000
    assert outcome[(True, "OK")] >= 150, outcome
    assert elapsed < 60, (elapsed, outcome)
