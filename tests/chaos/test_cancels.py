"""Duplicate ids, early cancels, Aborts and a cancellation storm on a real stack (2 prefill + 2
decode workers, real redis-server). A duplicate never touches the original; a cancel frees every
block on every worker within 100 ms, whatever the stage; an Abort ends the stream with a final
FINISH_REASON_ABORT message; nothing is left behind."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.protos.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.harness import assert_nothing_leaks, gateway, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
# NOTE: long enough that the original outlives three refused duplicates even when its client
# reads nothing meanwhile: the gateway then merges its tokens into few messages, which no
# longer wait on the client one by one. Also what an Abort after 3 chunks meets still running
# (those chunks can carry tens of tokens; a loaded host can delay the Abort).
LONGER = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
FREED_WITHIN_S = 0.1


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture
def stack(calm_stack):
    return calm_stack


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir)
    prompts = random_prompts([40, 90, 7, 150], llm.engine.model_config.vocab_size, seed=5)
    outs = llm.generate(prompts, LONG, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


class Pools:
    """GetStats on every worker over channels kept open (polling must be quick)."""

    def __init__(self, stack) -> None:
        self.stubs = []
        for w in workers(stack):
            channel = grpc.insecure_channel(w.address)
            kind = worker_pb2_grpc.PrefillWorkerStub if w.kind == "prefill" else None
            self.stubs.append((kind or worker_pb2_grpc.DecodeWorkerStub)(channel))
        assert len(self.stubs) == 4

    def busy(self) -> list[str]:
        held = []
        for stub in self.stubs:
            s = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)
            if s.num_free_blocks != s.num_total_blocks or s.num_requests or s.num_reservations:
                held.append(
                    f"{s.worker_id}: {s.num_total_blocks - s.num_free_blocks} blocks, "
                    f"{s.num_requests} requests, {s.num_reservations} reservations"
                )
        return held

    def seconds_until_free(self, since: float, limit_s: float = 5.0) -> float:
        """From `since` until a round of GetStats that began then found every block free (the
        round's own time is not counted: the workers were free when it asked them)."""
        while True:
            asked = time.monotonic()
            held = self.busy()
            if not held:
                return asked - since
            assert asked - since < limit_s, held
            time.sleep(0.005)


def _final(responses) -> tuple[list[int], gateway_pb2.Finished | None]:
    """The tokens streamed, and the final message (None if the stream ended without one)."""
    tokens: list[int] = []
    final = None
    for msg in responses:
        if msg.HasField("chunk"):
            tokens.extend(msg.chunk.token_ids)
        else:
            final = msg.finished
    return tokens, final


def test_a_duplicate_id_is_refused_and_the_original_runs_on(stack, model_dir, offline):
    stub = gateway(stack)
    prompts, expected = offline
    llm = LLM(model_dir)
    outs = llm.generate(prompts, LONGER, use_tqdm=False)
    longer = [o.outputs[0].token_ids for o in outs]
    for i, (prompt, tokens) in enumerate(zip(prompts, longer, strict=True)):
        rid = f"dup-{i}"
        original = stream(stub, prompt, LONGER, request_id=rid, timeout_s=60)
        # Half: the original is already streaming; half: it was sent 0.1 s before (queued,
        # prefilling or just decoding: it has arrived and claimed its id in Redis, which under
        # a loaded machine took longer than 50 ms; which of two calls in flight at once came
        # first is not defined).
        head = next(original) if i % 2 else time.sleep(0.1)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as err:
                collect(stream(stub, prompt[:3], LONG, request_id=rid, timeout_s=10))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value
            assert "already running" in err.value.details()
        rest = collect(original)
        got = (list(head.chunk.token_ids) if head else []) + rest.token_ids[0]
        assert got == tokens
        assert rest.finished.samples[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # Once the original ended, its id is free again.
    again = collect(stream(stub, prompts[0], LONG, request_id="dup-0", timeout_s=60))
    assert again.token_ids[0] == expected[0]
    assert_nothing_leaks(stack)


def test_a_cancel_at_any_stage_frees_every_block_within_100ms(stack, model_dir):
    stub, pools = gateway(stack), Pools(stack)
    rng = random.Random(7)
    prompts = random_prompts([rng.randint(20, 300) for _ in range(24)], 500, seed=8)
    waits = []
    for prompt in prompts:
        call = stream(stub, prompt, LONG, timeout_s=60)
        # From "at once" (queued, reserving) through prefill to decoding.
        time.sleep(rng.choice([0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3]))
        call.cancel()
        cancelled = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            collect(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        waits.append(pools.seconds_until_free(cancelled))
    assert max(waits) <= FREED_WITHIN_S, waits
    assert_nothing_leaks(stack)


def test_abort_before_the_request_arrives_ends_it_with_finish_reason_abort(stack):
    stub = gateway(stack)
    aborted = stub.Abort(common_pb2.AbortRequest(request_id="early-1"), timeout=5)
    assert not aborted.aborted  # nothing was running yet...
    tokens, final = _final(stream(stub, [5, 6, 7, 8], LONG, request_id="early-1", timeout_s=30))
    assert tokens == []  # ...but the request that comes after it is aborted at once
    assert [s.finish_reason for s in final.samples] == [common_pb2.FINISH_REASON_ABORT]
    assert final.usage.prompt_tokens == 4 and final.usage.completion_tokens == 0
    # An Abort for a request that ended is not remembered for the next one with its id.
    assert len(collect(stream(stub, [5, 6], LONG, request_id="done-1", timeout_s=60)).token_ids[0])
    assert not stub.Abort(common_pb2.AbortRequest(request_id="done-1"), timeout=5).aborted
    done = collect(stream(stub, [5, 6], LONG, request_id="done-1", timeout_s=60))
    assert done.finished.samples[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_nothing_leaks(stack)


@pytest.mark.parametrize("after_chunks", [0, 3])
def test_abort_of_a_running_request_ends_it_with_finish_reason_abort(stack, after_chunks):
    stub, pools = gateway(stack), Pools(stack)
    for i, length in enumerate([30, 200, 400]):
        rid = f"abort-{after_chunks}-{i}"
        responses = stream(stub, list(range(3, 3 + length)), LONGER, request_id=rid, timeout_s=60)
        received = []
        for _ in range(after_chunks):
            received.extend(next(responses).chunk.token_ids)
        asked = time.monotonic()
        answer = stub.Abort(common_pb2.AbortRequest(request_id=rid), timeout=5)
        # Right after the call the gateway may still be validating it (False: not running yet,
        # remembered); once it streams, it is running.
        assert answer.aborted or not after_chunks
        freed_in = pools.seconds_until_free(asked)
        tokens, final = _final(responses)
        assert final is not None, "the stream ended without a final message"
        assert [s.finish_reason for s in final.samples] == [common_pb2.FINISH_REASON_ABORT]
        assert final.usage.completion_tokens == len(received) + len(tokens) < LONGER.max_tokens
        assert freed_in <= FREED_WITHIN_S, freed_in
    assert_nothing_leaks(stack)


def test_a_cancellation_storm_leaves_nothing_behind(stack):
    stub = gateway(stack)
    rng = random.Random(11)
    lock = threading.Lock()
    outcomes: dict[str, int] = {}

    def one(i: int) -> None:
        r = random.Random(i)
        prompt = [r.randint(3, 499) for _ in range(r.randint(1, 250))]
        rid = f"storm-{i}"
        call = stream(stub, prompt, LONG, request_id=rid, timeout_s=60)
        time.sleep(r.uniform(0, 0.4))
        if i % 2:
            call.cancel()
        else:
            stub.Abort(common_pb2.AbortRequest(request_id=rid), timeout=10)
        try:
            _, final = _final(call)
            kind = common_pb2.FinishReason.Name(final.samples[0].finish_reason)
        except grpc.RpcError as err:
            kind = err.code().name
        with lock:
            outcomes[kind] = outcomes.get(kind, 0) + 1

    started = time.monotonic()
    with ThreadPoolExecutor(25) as pool:
        list(pool.map(one, rng.sample(range(1000), 100), timeout=90))
    assert time.monotonic() - started < 90
    # Cancelled by the client, or ended by Abort (or finished first): never anything else.
    assert set(outcomes) <= {"CANCELLED", "FINISH_REASON_ABORT", "FINISH_REASON_LENGTH"}, outcomes
    assert outcomes.get("CANCELLED", 0) >= 40 and outcomes.get("FINISH_REASON_ABORT", 0) >= 30
    assert_nothing_leaks(stack)
