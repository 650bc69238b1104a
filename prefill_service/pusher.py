"""Pushes a request's KV blocks to its decode worker as prefill chunks finish.

After every engine step (on the engine thread) the pusher snapshots the blocks that became
complete and hands them to a sender thread, so the next chunk computes while they travel:

    prompt   |== block 0 ==|== block 1 ==|== block 2 ==|= 3 (partial) =|
    step 1   [computed.......]                                           -> push 0
    step 2                   [computed.................]                 -> push 1
    step 3                                  [computed.....................] -> push 2, 3
Blocks the decode worker already caches (its `num_cached_tokens`) are never sent. Each send runs
under `trace_context` (the request's span), so that its `kv.push` span joins the request's trace.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future

from opentelemetry import context as otel_context

from splitserve.engine.llm_engine import LLMEngine
from splitserve.kv_transfer.transport import KVTransport, PushResult
from splitserve.kv_transfer.wire import CacheLayout, make_header, pack_blocks
from splitserve.protos.v1 import worker_pb2


class BlockPusher:
    def __init__(
        self,
        request_id: str,
        destination: worker_pb2.KVDestination,
        prompt_len: int,
        block_size: int,
        transport: KVTransport,
        executor: Executor,
        send_timeout_s: float,
        trace_context: otel_context.Context | None = None,
    ) -> None:
        self.request_id = request_id
        self.destination = destination
        self.prompt_len = prompt_len
        self.block_size = block_size
        self.transport = transport
        self.executor = executor
        self.send_timeout_s = send_timeout_s
        self.trace_context = trace_context
        self.num_blocks = -(-prompt_len // block_size)
        self._next_block = destination.num_cached_tokens // block_size
        self._futures: list[Future[PushResult]] = []
        self.all_scheduled = threading.Event()
        if self._next_block >= self.num_blocks:
            self.all_scheduled.set()

    def on_step(self, engine: LLMEngine) -> None:
        """Engine-thread hook: snapshot and send the blocks completed since the last step."""
        if self.all_scheduled.is_set() or not engine.has_request(self.request_id):
            return
        state = engine.outputs.requests.get(self.request_id)
        if state is None:
            return
        seq = state.sequences[0]
        if not engine.block_manager.has_seq(seq.seq_id):
            return  # preempted; it recomputes and the unsent blocks go later
        computed = min(seq.num_computed_tokens, self.prompt_len)
        ready = self.num_blocks if computed >= self.prompt_len else computed // self.block_size
        if ready <= self._next_block:
            return
        table = engine.block_table(self.request_id)
        src = list(table[self._next_block : ready])
        dst = list(self.destination.block_ids[self._next_block : ready])
        # NOTE: packed here, on the engine thread, because a later step may free (preemption)
        # and reuse these blocks while the send is still in flight.
        payload = pack_blocks(engine.runner.kv_caches, src)
        layout = CacheLayout.from_kv_caches(engine.runner.kv_caches)
        num_tokens_after = min(ready * self.block_size, self.prompt_len)
        self._futures.append(
            self.executor.submit(self._send, layout, dst, payload, num_tokens_after)
        )
        self._next_block = ready
        if ready >= self.num_blocks:
            self.all_scheduled.set()

    def _send(
        self, layout: CacheLayout, dst: list[int], payload: bytes, num_tokens_after: int
    ) -> PushResult:
        header = make_header(
            self.request_id,
            self.destination.fence,
            layout,
            dst,
            payload,
            0,
            layout.num_layers,
            num_tokens_after,
        )
        # NOTE: attached and detached on this (sender) thread, around one synchronous send.
        token = otel_context.attach(self.trace_context) if self.trace_context else None
        try:
            return self.transport.send(
                self.destination.address, header, payload, timeout_s=self.send_timeout_s
            )
        finally:
            if token is not None:
                otel_context.detach(token)

    def wait(self, timeout_s: float) -> tuple[int, int]:
        """Block until every push is acknowledged; return (blocks, bytes). Raises the first
        transfer error."""
        if not self.all_scheduled.wait(timeout_s):
            raise TimeoutError(f"prefill of {self.request_id!r} never completed its blocks")
        num_blocks = num_bytes = 0
        for future in self._futures:
            result = future.result(timeout_s)
            num_blocks += result.num_blocks
            num_bytes += result.num_bytes
        return num_blocks, num_bytes

    def cancel(self) -> None:
        for future in self._futures:
            future.cancel()
