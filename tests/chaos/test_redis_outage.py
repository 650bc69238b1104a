"""Redis killed (SIGKILL) and restarted empty on the same port while a stack serves: every
request completes with the offline engine's tokens or fails UNAVAILABLE (never INTERNAL, never
an error after its final message), fences issued after the restart are all greater than any
before it, the workers register again, and new requests are served."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest

from splitserve.client import stream
from splitserve.engine import LLM, SamplingParams
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, RegistryUnavailable
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
OUTAGE_S = 2.5
RETRY_S = "1.0"  # registry retries of every service: shorter than the outage, so both outcomes
NUM_CLIENTS = 4


@dataclass
class Outcome:
    request_id: str
    prompt: int  # index into the prompts
    tokens: list[int]
    code: grpc.StatusCode | None = None  # None: completed
    finished: bool = False  # a final message arrived


class FenceWatch:
    """Reads the fences of the block records in Redis while requests run: a real observation
    of what the registry issued (until `stop`)."""

    def __init__(self, url: str) -> None:
        self.registry = Registry(url, retry_s=0.0)
        self.seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.003):
            try:
                for key in self.registry.request_record_keys():
                    request_id = key.split(":req:", 1)[1]
                    record = self.registry.get_record(request_id)
                    if record is not None:
                        self.seen.setdefault(request_id, record.fence)
            except RegistryUnavailable:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.registry.close()


def _run(stub, request_id: str, index: int, prompt: list[int]) -> Outcome:
    out = Outcome(request_id, index, [])
    try:
        for msg in stream(stub, prompt, GREEDY, request_id=request_id, timeout_s=60):
            if msg.HasField("chunk"):
                out.tokens.extend(msg.chunk.token_ids)
            else:
                out.finished = True
    except grpc.RpcError as err:
        out.code = err.code()
    return out


@pytest.fixture
def redis_on_a_port() -> Iterator[list[RedisServer]]:
    """A Redis of the test's own, which it kills and starts again on the same port."""
    servers = [RedisServer()]
    yield servers
    for server in servers:
        server.stop()


def test_a_redis_restart_under_load_loses_nothing_that_could_finish(tiny_models, redis_on_a_port):
    model_dir = tiny_models["llama"]
    prompts = random_prompts([5, 40, 70, 23, 100, 12], 400, seed=71)
    llm = LLM(model_dir)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    del llm
    first = redis_on_a_port[0]
    retry = ("--registry-retry-s", RETRY_S)
    with running_stack(
        model_dir, 1, 1, redis_url=first.url, worker_args=retry, extra_gateway_args=retry
    ) as stack:
        stub = gateway(stack)
        outcomes: list[Outcome] = []
        load_done = threading.Event()

        def client(c: int) -> None:
            i = 0
            while not load_done.is_set():
                index = (c + i) % len(prompts)
                outcomes.append(_run(stub, f"load-{c}-{i}", index, prompts[index]))
                i += 1

        watch = FenceWatch(first.url)
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            clients = [pool.submit(client, c) for c in range(NUM_CLIENTS)]
            try:
                time.sleep(1.5)
                before = dict(watch.seen)
                port = first.port
                os.kill(first.pid or 0, signal.SIGKILL)
                time.sleep(OUTAGE_S)
                first.stop()
                redis_on_a_port.append(RedisServer(port=port))
                deadline = time.monotonic() + 15
                while {w.kind for w in _workers_or_none(stack)} != {"prefill", "decode"}:
                    assert time.monotonic() < deadline, "the workers did not register again"
                    time.sleep(0.1)
                # New requests, sent once Redis is back: all must be served.
                after = [_run(stub, f"after-{i}", i, p) for i, p in enumerate(prompts)]
            finally:
                load_done.set()
                watch.stop()
            for future in clients:
                future.result(timeout=120)

        for out in after:
            assert out.code is None, f"{out.request_id} failed after the restart: {out.code}"
            assert out.tokens == expected[out.prompt], out.request_id
        for out in outcomes:
            if out.code is None:
                assert out.tokens == expected[out.prompt], out.request_id
            else:
                assert out.code == grpc.StatusCode.UNAVAILABLE, (out.request_id, out.code)
                assert not out.finished, f"{out.request_id}: an error after its final message"
        assert sum(out.code is None for out in outcomes) >= NUM_CLIENTS

        fences_before = list(before.values())
        fences_after = [f for rid, f in watch.seen.items() if rid.startswith("after-")]
        assert len(fences_before) >= 3 and len(fences_after) >= 3, (before, watch.seen)
        assert min(fences_after) > max(fences_before)
        assert_nothing_leaks(stack, timeout_s=15)


def _workers_or_none(stack):
    try:
        return workers(stack)
    except RegistryUnavailable:
        return []
