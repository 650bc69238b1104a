"""A burst of requests arriving at once is spread over the decode workers.

The gateway picks a decode worker in a thread (the registry is a blocking Redis client), so
many picks run at once. Each must see the ones before it: a pick that read the in-flight counts
before another counted its choice would send the whole burst to the same least-loaded worker.
Real Redis, real registry, the gateway's own orchestrator; no worker process is needed to pick.
"""

from __future__ import annotations

import asyncio

from splitserve.engine import SamplingParams
from splitserve.gateway.orchestrator import Orchestrator, OrchestratorSettings
from splitserve.gateway.router import make_policy
from splitserve.gateway.validation import Job
from splitserve.kv_transfer.registry import Registry, WorkerInfo

BURST = 48


class Routes:
    """Where each pick went, as the request's observation is told."""

    def __init__(self) -> None:
        self.decode: list[str] = []

    def routed(self, kind: str, worker_id: str, reason: str) -> None:
        self.decode.append(worker_id)


def test_a_burst_of_picks_is_split_evenly_and_counted(registry: Registry) -> None:
    for name in ("d0", "d1"):
        registry.register_worker(WorkerInfo(name, "decode", f"127.0.0.1:{len(name)}"), ttl_s=30.0)
    policy = make_policy("least-loaded-prefix")
    orch = Orchestrator(registry, policy, OrchestratorSettings(block_size=16))
    obs = Routes()
    params = SamplingParams(max_tokens=1)
    # NOTE: distinct first tokens: no prompt shares a block with another (no prefix bonus)
    jobs = [Job(f"r{i}", [3 + i] * 40, params, priority=0) for i in range(BURST)]

    async def burst() -> list:
        return await asyncio.gather(*(orch._pick_decode(j, obs, exclude=()) for j in jobs))

    picks = asyncio.run(burst())
    counts = {name: obs.decode.count(name) for name in ("d0", "d1")}
    assert counts == {"d0": BURST // 2, "d1": BURST // 2}, counts
    assert sorted(p.worker.worker_id for p in picks) == sorted(obs.decode)
    # Each pick came counted in flight for its worker; releasing them all leaves none.
    assert orch._inflight == counts
    for p in picks:
        orch._count(p.worker.worker_id, -1)
    assert orch._inflight == {"d0": 0, "d1": 0}
