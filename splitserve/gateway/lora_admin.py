"""Loading and unloading LoRA adapters on every live worker at run time (the gateway's
`LoadLoRAAdapter` / `UnloadLoRAAdapter`, and vLLM's `/v1/load_lora_adapter` /
`/v1/unload_lora_adapter` on the HTTP API).

    gateway ──LoadAdapter(name, path)──▶ every live prefill, decode and colocated worker
            ◀── the adapters each now serves; then waits until their registry records say so

A load returns once every worker's record lists the adapter, so the next request finds it
(`limits.AdvertisedLimits` re-reads the records before refusing an adapter it has not seen).
Requests in flight go on: a load touches only host memory until a step first uses the adapter.
An unload that a worker refuses because a request still uses the adapter is returned as that
worker's FAILED_PRECONDITION: unload once they finish (workers that had no such request have
unloaded it).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from splitserve.engine.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    Unavailable,
    quoted,
)
from splitserve.engine.lora.request import check_adapter_name
from splitserve.gateway.limits import AdvertisedLimits
from splitserve.gateway.stubs import Stubs
from splitserve.kv_transfer.registry import WORKER_KINDS, Registry, WorkerInfo
from splitserve.protos.v1 import worker_pb2

# How long a load waits for the workers' records to list the adapter (a few heartbeats).
ADVERTISE_TIMEOUT_S = 10.0


class AdapterAdmin:
    def __init__(
        self,
        registry: Registry,
        stubs: Stubs,
        limits: AdvertisedLimits | None = None,
        rpc_timeout_s: float = 60.0,
    ) -> None:
        """`limits`: the gateway's view of what workers advertise, re-read after each change
        (so /v1/models and the NOT_FOUND check see it at once)."""
        self.registry = registry
        self.stubs = stubs
        self.limits = limits
        self.rpc_timeout_s = rpc_timeout_s

    async def load(self, name: str, path: str) -> list[str]:
        """Load `name` from `path` on every live worker; their ids."""
        check_adapter_name(name)
        if not path:
            raise NotFound(f"LoRA adapter {quoted(name)}: no lora_path given")
        request = worker_pb2.LoadAdapterRequest(name=name, path=path)
        ids = await self._each("LoadAdapter", request)
        await self._advertised(name, ids, present=True)
        return ids

    async def unload(self, name: str) -> list[str]:
        """Unload `name` from every live worker that serves it; their ids."""
        check_adapter_name(name)
        workers = [w for w in await self._workers() if name in w.adapters]
        if not workers:
            raise NotFound(f"LoRA adapter {quoted(name)} is not served by any live worker")
        request = worker_pb2.UnloadAdapterRequest(name=name)
        # NOTE: a worker that says NOT_FOUND has it unloaded already (an earlier unload it
        # took while another worker refused, not yet in its heartbeat): that is the goal.
        ids = await self._each("UnloadAdapter", request, workers, done=grpc.StatusCode.NOT_FOUND)
        await self._advertised(name, ids, present=False)
        return ids

    async def _workers(self) -> list[WorkerInfo]:
        return [
            w
            for kind in WORKER_KINDS
            for w in await asyncio.to_thread(self.registry.live_workers, kind)
        ]

    async def _each(
        self,
        method: str,
        request: object,
        workers: list[WorkerInfo] | None = None,
        done: grpc.StatusCode | None = None,
    ) -> list[str]:
        """Call `method` on every worker (all live ones by default); their ids. A worker's error
        fails the whole call, unless its code is `done` (the state asked for holds there)."""
        workers = workers if workers is not None else await self._workers()
        if not workers:
            raise Unavailable("no live worker to load the adapter on")

        async def one(worker: WorkerInfo) -> None:
            stubs = self.stubs.prefill if worker.kind == "prefill" else self.stubs.decode
            await getattr(stubs(worker.address), method)(request, timeout=self.rpc_timeout_s)

        results = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, grpc.RpcError):
                if result.code() != done:
                    raise _domain(result.code(), f"{worker.worker_id}: {result.details()}")
            elif isinstance(result, BaseException):
                raise result
        return [w.worker_id for w in workers]

    async def _advertised(self, name: str, ids: list[str], present: bool) -> None:
        deadline = time.monotonic() + ADVERTISE_TIMEOUT_S
        while time.monotonic() < deadline:
            listed = {w.worker_id: name in w.adapters for w in await self._workers()}
            if all(listed.get(i, present) == present for i in ids):
                if self.limits is not None:
                    await asyncio.to_thread(self.limits.current, True)
                return
            await asyncio.sleep(0.05)
        raise Unavailable(f"the workers did not advertise LoRA adapter {quoted(name)} in time")


def _domain(code: grpc.StatusCode, message: str) -> Exception:
    """A worker's status as the gateway's own domain error (the same code, its message)."""
    errors: dict[grpc.StatusCode, type[Exception]] = {
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
        grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
        grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    }
    return errors.get(code, Unavailable)(message)
