"""A moved Decode stream's KV handed from the worker that began it to the one that resumes it,
instead of recomputed there (`migration.py` decides when; `decode_service/handoff.py` is the
worker's side).

A decode worker that changes role (`--role-switch`) ends its streams UNAVAILABLE "changing
role" and, for each whose KV it kept, says in the trailer how many tokens that KV covers. The
new decode worker D2 needs the KV of the prompt and of every token the client has but the last
(the last is its next input); when D1 keeps at least that much:

    gateway ──Reserve(prompt, resume = tokens 0..k)──▶ D2   (blocks; its cached prefix reused)
            ──HandOff(D1's id, D2's reservation, prompt + k - 1 tokens)──▶ D1 ══KV══▶ D2
            ──Decode(resume, kv_handed_off)──▶ D2: decodes on from token k, nothing recomputed

Any failure (D1 gone, no transport in common, a push refused) falls back to the recompute:
Decode without `kv_handed_off`; D1 frees the blocks either way.
"""

from __future__ import annotations

import logging

import grpc

from splitserve.engine.errors import quoted
from splitserve.gateway.stubs import Stubs
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.protos import convert
from splitserve.protos.v1 import worker_pb2

log = logging.getLogger(__name__)

HANDED_OFF, RECOMPUTED = "handed_off", "recomputed"
"""How a moved stream's KV reached its new decode worker (`stream_migrations_total{kv}`)."""


def kv_kept(err: BaseException) -> int | None:
    """Tokens of KV the worker of a stream that ended with `err` keeps for a hand-off (None:
    none; the worker died, stalled, or could not keep it)."""
    trailing = getattr(err, "trailing_metadata", None)
    if not isinstance(err, grpc.RpcError) or not callable(trailing):
        return None
    try:
        return convert.kv_kept_from_trailer(trailing())
    except Exception:  # noqa: BLE001 - a malformed trailer: recompute
        return None


async def hand_off(
    stubs: Stubs,
    source: WorkerInfo,
    request_id: str,
    destination: worker_pb2.KVDestination,
    destination_request_id: str,
    num_tokens: int,
    timeout_s: float,
) -> bool:
    """Ask `source` to push `request_id`'s KV of `num_tokens` tokens into `destination`; False
    (logged) if that did not happen, and the stream is recomputed."""
    try:
        reply = await stubs.decode(source.address).HandOff(
            worker_pb2.HandOffRequest(
                request_id=request_id,
                destination=destination,
                num_tokens=num_tokens,
                destination_request_id=destination_request_id,
            ),
            timeout=timeout_s,
        )
    except grpc.RpcError as err:
        log.warning(
            "hand-off of %s's KV from %s to %s failed (%s: %s); recomputing it",
            quoted(request_id), source.worker_id, destination.worker_id, err.code().name,
            quoted(err.details(), 200),
        )  # fmt: skip
        return False
    log.info(
        "request %s: %d tokens of KV (%d blocks) handed from %s to %s",
        quoted(request_id), num_tokens, reply.num_blocks_sent, source.worker_id,
        destination.worker_id,
    )  # fmt: skip
    return True
