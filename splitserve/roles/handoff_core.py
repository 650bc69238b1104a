"""The engine core's side of a KV hand-off (`--role-switch` workers only: they hold KV senders
beside their receivers): a stream this worker moved off while changing role keeps its blocks
(`engine/parking.py`); the `hand_off` command pushes the KV of its first `num_tokens` tokens
into the reservation of the decode worker that resumes it, with the transport the front chose,
then frees them, whatever the outcome:

    parked blocks  |== 0 ==|== 1 ==|== 2 ==|= 3 (partial) =|
    destination     cached  [push 1 .. 3, one batch ...........]  (its cached prefix not sent)

With sliding layers kept apart, the blocks the destination gave window slots (those its first
query sees) take their sliding layers' KV along, from the slots pinned with them here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kv_transfer.transport import (
    KVSender,
    Peer,
    Push,
    PushResult,
    TransferError,
    window_pairs,
)
from splitserve.protos.v1 import worker_pb2


def hand_off(
    loop: EngineLoop,
    senders: Mapping[str, KVSender],
    request_id: str,
    destination: bytes,
    destination_request_id: str,
    num_tokens: int,
    transport: str,
    peer: list[Any],
    timeout_s: float,
) -> list[int]:
    """Push parked `request_id`'s KV of `num_tokens` leading tokens into `destination` (a
    serialized KVDestination, held under `destination_request_id`); [blocks, bytes] sent.
    Raises NotFound (nothing parked), FailedPrecondition or TransferError; the parked blocks
    are freed in every case."""
    dest = worker_pb2.KVDestination.FromString(destination)
    sender = senders.get(transport)
    if sender is None:
        with contextlib.suppress(Exception):
            loop.call(lambda e: e.abort_request(request_id))
        raise TransferError(f"this worker has no {transport} sender", "FAILED_PRECONDITION")
    first = dest.num_cached_tokens // loop.engine.config.block_size
    # NOTE: the destination's window slots name the blocks whose sliding layers go too
    window_from = next((i for i, s in enumerate(dest.window_slots) if s and i >= first), None)
    parked = loop.call(lambda e: e.take_parked_kv(request_id, num_tokens, window_from))
    src = parked.block_ids
    try:
        if len(src) > len(dest.block_ids):
            raise TransferError(
                f"the destination reserved {len(dest.block_ids)} blocks, the KV of {num_tokens} "
                f"tokens takes {len(src)}",
                "FAILED_PRECONDITION",
            )
        if first >= len(src):
            return [0, 0]  # NOTE: the destination caches all of it already
        src_slots, dst_slots = window_pairs(
            parked.window_slots[first:], dest.window_slots[first : len(src)], len(src) - first
        )
        push = Push(
            destination_request_id, dest.fence, src[first:],
            tuple(dest.block_ids[first : len(src)]), num_tokens, None, dest.capability,
            src_slots, dst_slots,
        )  # fmt: skip
        result: PushResult = sender.push(Peer(peer[0], peer[1], dict(peer[2])), push, timeout_s)
        return [result.num_blocks, result.num_bytes]
    finally:
        if loop.running:
            loop.call(lambda e: _unpin(e, src, parked.window_slots))


def _unpin(engine: LLMEngine, block_ids: tuple[int, ...], window_slots: tuple[int, ...]) -> None:
    engine.unpin_blocks(block_ids, window_slots)
