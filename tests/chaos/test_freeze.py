"""A frozen decode worker costs seconds, and a busy one is never taken for a frozen one.

With the gateway's defaults (no failover flag set): a decode worker SIGSTOPped under load has its
streams resume on the other one within 3 s (4 s allowed on two busy CPU cores; tokens equal
to the offline engine's), and new requests
sent after the freeze take under 1.5 s more each than the same requests did just before it, under
the same load. A worker whose engine core alone is frozen (its front still answers) leaves the
registry, its streams move, and it joins again when the core goes on. At full batch on the CPU,
with the longest steps (2048-token chunks) and the default deadlines (paced by each worker's own
waits), no worker leaves the registry and none is suspected. A Reserve sent to a frozen decode
worker is hedged on the other one and answered within the hedge delay and a margin, and what the
frozen one grants when it goes on is freed. With one decode worker, a Reserve it answers past its
deadline is asked again rather than failed. Each test ends with the leak check.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from splitserve.client import stream
from splitserve.engine import LLM, SamplingParams
from splitserve.launch.up import Stack
from tests.chaos.test_worker_death import _engine_core_pid, _wait_busy
from tests.e2e.harness import (
    assert_nothing_leaks,
    gateway,
    metric,
    running_stack,
    stats,
    workers,
)
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

RESUME_S = 3.0  # a frozen worker's streams go on elsewhere within this
NEW_REQUEST_S = 1.5  # what the freeze adds at most to a request sent after it
HEDGE_S = 0.3  # --reserve-hedge-s's default


@dataclass
class Timed:
    """A streamed reply with when each of its chunks came."""

    token_ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    sent: float = 0.0
    done: float = 0.0

    def gap_after(self, when: float) -> float:
        """Seconds from `when` to its first chunk after it (0: it had ended by then)."""
        later = [t for t in self.arrivals if t > when]
        return later[0] - when if later else 0.0


def _timed(stack: Stack, prompt: list[int], params: SamplingParams, request_id: str) -> Timed:
    out = Timed(sent=time.monotonic())
    for msg in stream(gateway(stack), prompt, params, request_id, timeout_s=120):
        if msg.HasField("chunk"):
            out.token_ids.extend(msg.chunk.token_ids)
            out.arrivals.append(time.monotonic())
        else:
            out.completion_tokens = msg.finished.usage.completion_tokens
    out.done = time.monotonic()
    return out


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _offline(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _counter(stack: Stack, name: str, **labels: str) -> float:
    return metric(stack, "gateway", name, **labels)


def _until(what, timeout_s: float) -> float:
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


def _live_ids(stack: Stack) -> set[str]:
    return {w.worker_id for w in workers(stack)}


def _reclaimed(stack: Stack) -> int:
    """Reservations the decode workers took back when their lease ran out (none was freed)."""
    return sum(stats(w, stack).num_reclaimed for w in workers(stack) if w.kind == "decode")


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"])


def test_a_frozen_decode_worker_under_load_costs_seconds_with_default_deadlines(tiny_models, llm):
    prompts = random_prompts([20 + 2 * i for i in range(24)], 500, seed=81)
    # NOTE: still running on decode-0 after the requests sent before, however fast the host
    long = _greedy(1000)
    fresh = random_prompts([24] * 8, 500, seed=82)
    short = _greedy(4)
    expected = _offline(llm, prompts, long)
    expected_fresh = _offline(llm, fresh, short)
    # NOTE: room on one decode worker for every stream at full length (24 x ~1070 tokens): with
    # the harness's 400 blocks the survivor preempts, and a preempted stream is silent until
    # room frees, which is capacity, not the failover this test times.
    room = ("--num-kv-blocks", "2048")
    with (
        running_stack(
            tiny_models["llama"], prefill=2, decode=2, worker_args=room, metrics=True
        ) as stack,
        ThreadPoolExecutor(32) as pool,
    ):
        futures: list[Future[Timed]] = [
            pool.submit(_timed, stack, p, long, f"load-{i}") for i, p in enumerate(prompts)
        ]
        _wait_busy(stack, "decode-0", 6)
        # The same requests under the same load before the freeze: what the host's cores
        # alone cost them (two cores, six processes), which the freeze's cost is added to.
        before = [pool.submit(_timed, stack, p, short, f"before-{i}") for i, p in enumerate(fresh)]
        unfrozen_s = max(f.result(timeout=60).done - f.result().sent for f in before)
        frozen = stack.process("decode-0")
        os.kill(frozen.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            time.sleep(0.5)
            new = [pool.submit(_timed, stack, p, short, f"new-{i}") for i, p in enumerate(fresh)]
            answered = [f.result(timeout=60) for f in new]
            results = [f.result(timeout=120) for f in futures]
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        for i, got in enumerate(answered):
            assert got.token_ids == expected_fresh[i], f"new-{i}"
            took = got.done - got.sent
            assert took < unfrozen_s + NEW_REQUEST_S, f"new-{i}: {took:.2f} s ({unfrozen_s:.2f})"
        for i, got in enumerate(results):
            assert got.token_ids == expected[i], f"load-{i}"
            assert got.completion_tokens == long.max_tokens
        gaps = sorted(got.gap_after(frozen_at) for got in results)
        # NOTE: up to 3.8 s seen in full runs on two CPU cores (1 in 3): the moved streams' KV
        # is recomputed by the prefill workers while every other stream runs on
        resume_s = RESUME_S + 1.0
        assert gaps[-1] < resume_s, f"silent for {gaps[-1]:.2f} s after the freeze: {gaps}"
        assert _counter(stack, "splitserve:stream_migrations_total") >= 1
        assert_nothing_leaks(stack, timeout_s=20)


def test_a_frozen_engine_core_takes_its_worker_out_until_it_turns_again(tiny_models, llm):
    """SIGSTOP of the engine core alone: the worker's front still heartbeats, but its loop
    does not turn, so it leaves the registry (`--engine-stall-s`, default 2 s), its streams
    move, and it is back once the core goes on."""
    prompts = random_prompts([20 + 3 * i for i in range(12)], 500, seed=83)
    params = _greedy(160)
    expected = _offline(llm, prompts, params)
    with (
        running_stack(tiny_models["llama"], prefill=1, decode=2, metrics=True) as stack,
        ThreadPoolExecutor(12) as pool,
    ):
        futures = [
            pool.submit(_timed, stack, p, params, f"core-{i}") for i, p in enumerate(prompts)
        ]
        _wait_busy(stack, "decode-0", 4)
        core = _engine_core_pid(stack.process("decode-0").pid)
        os.kill(core, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            left = _until(lambda: "decode-0" not in _live_ids(stack), timeout_s=10)
            assert left < 2.0 + 1.0  # --engine-stall-s, and a heartbeat or so
            results = [f.result(timeout=120) for f in futures]
        finally:
            os.kill(core, signal.SIGCONT)
        _until(lambda: "decode-0" in _live_ids(stack), timeout_s=10)
        for i, got in enumerate(results):
            assert got.token_ids == expected[i], f"core-{i}"
        gaps = sorted(got.gap_after(frozen_at) for got in results)
        # NOTE: all 12 streams move to the one decode worker left at once; on two CPU cores
        # their re-prefills and Reserves queued behind its steps once took 6 s after it left.
        # The bound is what says the move is driven by the stall, not by a 30 s failover.
        assert gaps[-1] < left + 3 * RESUME_S, f"silent {gaps[-1]:.2f} s; left after {left:.2f} s"
        assert _counter(stack, "splitserve:stream_migrations_total") >= 1
        assert_nothing_leaks(stack, timeout_s=20)


def test_full_batch_on_the_cpu_with_the_longest_steps_raises_no_false_suspicion(tiny_models, llm):
    """Both decode workers at their largest batch (more streams than --max-num-seqs), with
    2048-token chunks (the longest steps on the CPU, about 1 s on two busy cores) and the
    default deadlines, which scale with each worker's own pace: no worker leaves the registry
    for a moment, none is suspected, no stream moves."""
    prompts = random_prompts([300 + 20 * (i % 10) for i in range(72)], 500, seed=84)
    params = _greedy(48)
    expected = _offline(llm, prompts, params)
    with (
        running_stack(
            tiny_models["llama"], prefill=1, decode=2, metrics=True,
            worker_args=("--max-num-batched-tokens", "2048", "--max-num-seqs", "32"),
            extra_gateway_args=("--local-prefill-tokens", "400"),
        ) as stack,
        ThreadPoolExecutor(72) as pool,
    ):  # fmt: skip
        # NOTE: a worker's deadlines are paced by the waits the gateway has seen from it; a
        # cold one has none, so its first Reserves get the 1 s floor, which a first wave on two
        # saturated cores once missed (a known limit, not this test's subject): a few requests
        # first, so that both decode workers have answered.
        warm = [
            pool.submit(_timed, stack, p, _greedy(2), f"warm-{i}")
            for i, p in enumerate(prompts[:4])
        ]
        for f in warm:
            f.result(timeout=120)
        everyone = _live_ids(stack)
        missing: list[set[str]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.05):
                gone = everyone - _live_ids(stack)
                if gone:
                    missing.append(gone)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            futures = [
                pool.submit(_timed, stack, p, params, f"full-{i}") for i, p in enumerate(prompts)
            ]
            results = [f.result(timeout=300) for f in futures]
        finally:
            stop.set()
            watcher.join()
        for i, got in enumerate(results):
            assert got.token_ids == expected[i], f"full-{i}"
        assert not missing, f"workers left the registry under load: {missing[:5]}"
        assert _counter(stack, "splitserve:worker_suspicions_total") == 0
        assert _counter(stack, "splitserve:stream_migrations_total") == 0
        assert_nothing_leaks(stack)
        assert _reclaimed(stack) == 0  # NOTE: the hedges' losers were freed, not left to lapse


def _asked_while_held(
    stack: Stack, pid: int, prompt: list[int], params: SamplingParams, request_id: str
) -> Timed:
    """One request sent while process `pid` is SIGSTOPped, which goes on 0.8 s later."""
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(_timed, stack, prompt, params, request_id)
            time.sleep(0.8)
            os.kill(pid, signal.SIGCONT)
            return asked.result(timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_reserve_past_its_deadline_asks_the_only_decode_worker_again(tiny_models, llm):
    """With one decode worker, a Reserve it answers late (frozen for a moment, not gone from
    the registry) is asked again, not failed DEADLINE_EXCEEDED: the request completes."""
    prompt = random_prompts([40], 500, seed=85)[0]
    params = _greedy(8)
    expected = _offline(llm, [prompt], params)[0]
    with running_stack(
        tiny_models["llama"], prefill=1, decode=1, metrics=True,
        extra_gateway_args=("--reserve-timeout-s", "0.3"),
    ) as stack:  # fmt: skip
        # NOTE: held shorter than its heartbeat TTL (1.5 s)
        got = _asked_while_held(stack, stack.process("decode-0").pid, prompt, params, "late")
        assert got.token_ids == expected
        assert _counter(stack, "splitserve:worker_suspicions_total") >= 1  # it was late
        assert_nothing_leaks(stack)


def test_a_reserve_granted_after_its_deadline_does_not_collide_with_the_next(tiny_models, llm):
    """A busy decode worker (its engine core held for a moment; its front answers) takes the
    Reserve in but grants it after the gateway's deadline. The gateway asks again, under a new
    id, so the late grant can't meet the next one's claim or block record (which failed such
    requests ALREADY_EXISTS / FAILED_PRECONDITION under load on GPUs): the request completes
    with the offline engine's tokens and the late grant leaves nothing behind."""
    prompt = random_prompts([40], 500, seed=86)[0]
    params = _greedy(8)
    expected = _offline(llm, [prompt], params)[0]
    with running_stack(
        tiny_models["llama"], prefill=1, decode=1, metrics=True,
        extra_gateway_args=("--reserve-timeout-s", "0.3"),
    ) as stack:  # fmt: skip
        core = _engine_core_pid(stack.process("decode-0").pid)
        # NOTE: held shorter than --engine-stall-s (2 s)
        got = _asked_while_held(stack, core, prompt, params, "granted-late")
        assert got.token_ids == expected
        assert _counter(stack, "splitserve:worker_suspicions_total") >= 1  # it was late
        assert_nothing_leaks(stack, timeout_s=20)


def test_a_reserve_to_a_frozen_decode_worker_is_answered_by_the_other_after_the_hedge(
    tiny_models, llm
):
    """With both decode workers idle a new request's Reserve goes to decode-0 (equals: the
    first id). decode-0 is SIGSTOPped just before (its record lives on for the heartbeat TTL):
    the Reserve is hedged on decode-1 after --reserve-hedge-s and the request completes within
    that and a margin, with no suspicion (the frozen worker is slower than the hedge, not past
    its deadline). Once decode-0 goes on, what it may grant late is freed well within its
    10 s lease (the leak check waits 3 s at most)."""
    prompt, *warm = random_prompts([40, 36, 44], 500, seed=86)
    params = _greedy(4)
    expected = _offline(llm, [prompt], params)[0]
    with (
        running_stack(tiny_models["llama"], prefill=1, decode=2, metrics=True) as stack,
        ThreadPoolExecutor(2) as pool,
    ):
        # NOTE: one request on each decode worker first (its first steps are slower)
        for f in [pool.submit(_timed, stack, p, params, f"warm-{i}") for i, p in enumerate(warm)]:
            f.result(timeout=60)
        assert_nothing_leaks(stack)
        frozen = stack.process("decode-0")
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            got = _timed(stack, prompt, params, "hedged")
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        assert got.token_ids == expected
        took = got.done - got.sent
        # NOTE: sooner than the 1 s Reserve deadline alone allows (0.35 to 0.52 s measured on
        # two busy CPU cores); no suspicion: the hedge answered before decode-0's deadline
        assert took < HEDGE_S + 0.7, f"took {took:.2f} s"
        assert _counter(stack, "splitserve:routing_decisions_total", reason="hedge") == 1
        assert _counter(stack, "splitserve:worker_suspicions_total") == 0
        assert_nothing_leaks(stack, timeout_s=3)
        assert _reclaimed(stack) == 0


def test_a_suspect_decode_worker_still_takes_the_hedge_of_a_frozen_one(tiny_models, llm):
    """decode-1 is suspect (it froze long enough to leave the registry and lose its stream) and
    back; then decode-0 freezes. A new request goes to decode-0 (the one not suspect) and its
    Reserve is hedged on decode-1 after --reserve-hedge-s, as it would be on a worker not
    suspect: the only other live worker is better than waiting out a frozen one's deadline (a
    worker once made suspect by a slow first Reserve on two busy cores cost a request 6 s
    this way). Answering it in time, decode-1 is no longer suspect."""
    prompt, *others = random_prompts([40, 36, 44, 30, 38], 500, seed=87)
    params = _greedy(4)
    expected = _offline(llm, [prompt], params)[0]
    long = _greedy(400)
    expected_long = _offline(llm, others[2:], long)
    # NOTE: a Reserve deadline well past the hedge (3 s): what a request waits without it
    slow = ("--reserve-timeout-s", "3")
    with (
        running_stack(
            tiny_models["llama"], prefill=1, decode=2, metrics=True, extra_gateway_args=slow
        ) as stack,
        ThreadPoolExecutor(2) as pool,
    ):
        for f in [
            pool.submit(_timed, stack, p, params, f"warm-{i}") for i, p in enumerate(others[:2])
        ]:
            f.result(timeout=60)
        # NOTE: one long stream on each decode worker: the second is sent once the first runs
        # (sent together, both were once routed to decode-0), so it goes to the less loaded
        streams = [pool.submit(_timed, stack, others[2], long, "long-0")]
        _wait_busy(stack, "decode-0", 1)
        streams.append(pool.submit(_timed, stack, others[3], long, "long-1"))
        _wait_busy(stack, "decode-1", 1)
        lost = stack.process("decode-1")
        os.kill(lost.pid, signal.SIGSTOP)
        try:
            _until(lambda: "decode-1" not in _live_ids(stack), timeout_s=10)
            _until(lambda: _counter(stack, "splitserve:worker_suspicions_total") >= 1, 20)
        finally:
            os.kill(lost.pid, signal.SIGCONT)
        _until(lambda: "decode-1" in _live_ids(stack), timeout_s=10)
        assert [f.result(timeout=120).token_ids for f in streams] == expected_long
        assert_nothing_leaks(stack, timeout_s=20)
        frozen = stack.process("decode-0")
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            got = _timed(stack, prompt, params, "hedged-on-suspect")
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        assert got.token_ids == expected
        took = got.done - got.sent
        # NOTE: the hedge waits --reserve-hedge-s, paced by decode-0's recent Reserve answers
        # up to 1 s (0.33-0.35 s measured on two CPU cores); without the hedge on a suspect
        # worker, decode-0's 3 s Reserve deadline passes first and the request is asked again
        assert took < 1.0 + 0.5, f"took {took:.2f} s"
        print(f"hedged on the suspect worker: {took:.2f} s")
        assert _counter(stack, "splitserve:routing_decisions_total", reason="hedge") >= 1
        assert_nothing_leaks(stack, timeout_s=3)
