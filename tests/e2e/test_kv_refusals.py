"""A decode worker (a real process, real Redis) refuses KV from a writer that does not hold the
reservation, over each transport: a stale fence, an unknown request and a push without the
reservation's capability are refused, the request
is never admitted with that KV (Decode fails FAILED_PRECONDITION at once, not after a timeout),
and nothing is left behind. A rogue sender here is a real transport over its own pool, which
a member published (a NIXL receiver hears only those)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from splitserve.engine import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.model_config import ModelConfig
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.transport import Peer, Push, TransferError, transport_kind
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.harness import assert_nothing_leaks, running_stack, workers

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(10, 60))  # 50 tokens: 4 blocks of 16


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def setup(tiny_models, request):
    model = tiny_models["llama"]
    with running_stack(model, prefill=1, decode=1, kv_transport=request.param) as stack:
        (decode,) = [w for w in workers(stack) if w.kind == "decode"]
        cfg = ModelConfig.from_pretrained(model)
        pool = torch.randn(64, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
        connector = KVConnector(KVCache.over(pool), BlockManager(64, 16), 16)
        sender = transport_kind(request.param).sender(connector, "rogue")
        registry = Registry(stack.redis_url)
        # A member's sender, vouched for in the registry: a decode worker does not even read a
        # stranger's NIXL notifications (tests/security/test_nixl_strangers.py). It sits at the
        # prefill worker's address, which the leak checks ask for stats.
        (prefill,) = [w for w in workers(stack) if w.kind == "prefill"]
        rogue = WorkerInfo("rogue", "prefill", prefill.address, block_size=16)
        registry.register_worker(rogue, ttl_s=600, kv_endpoint=sender.endpoint())
        endpoint = registry.kv_endpoint(decode.worker_id) or {}
        peer = Peer(decode.worker_id, decode.address, endpoint)
        channel = grpc.insecure_channel(decode.address)
        try:
            yield stack, worker_pb2_grpc.DecodeWorkerStub(channel), sender, peer
        finally:
            registry.deregister_worker("prefill", "rogue")
            channel.close()
            sender.close()
            registry.close()


def _reserve(stub, request_id: str) -> worker_pb2.KVDestination:
    reply = stub.Reserve(
        worker_pb2.ReserveRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            sampling=convert.sampling_to_proto(GREEDY),
        ),
        timeout=10,
    )
    return reply.destination


def _decode(stub, request_id: str) -> grpc.RpcError:
    """Decode with a first token: it must be refused, and quickly."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id=request_id,
                    sampling=convert.sampling_to_proto(GREEDY),
                    first_tokens=[worker_pb2.FirstToken(index=0, token_id=7)],
                ),
                timeout=30,
            )
        )
    assert time.monotonic() - started < 10, "a refused push fails Decode at once"
    return err.value


def _push(
    sender, peer, request_id: str, fence: int, dst, capability: bytes = b""
) -> TransferError | None:
    """The push's refusal when the transport is two-sided (gRPC), else None (a one-sided NIXL
    write lands and the receiver refuses its notification)."""
    src = tuple(range(len(dst)))
    push = Push(request_id, fence, src, tuple(dst), len(PROMPT), capability=capability)
    try:
        sender.push(peer, push, timeout_s=10)
    except TransferError as exc:
        return exc
    return None


def _abort(stub, request_id: str) -> None:
    stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=10)


def test_a_stale_fence_is_refused_and_the_request_never_admitted(setup):
    stack, stub, sender, peer = setup
    dest = _reserve(stub, "stale-1")
    refused = _push(sender, peer, "stale-1", dest.fence + 1, dest.block_ids)
    if sender.name == "grpc":
        assert refused is not None and refused.status == "FAILED_PRECONDITION"
        assert "stale fencing token" in str(refused)
        _abort(stub, "stale-1")
    else:
        assert refused is None
        err = _decode(stub, "stale-1")
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "incomplete" in err.details() and "stale fencing token" in err.details()
    assert_nothing_leaks(stack)


def test_a_late_push_from_an_aborted_reservations_writer_leaves_the_fresh_one_be(setup):
    """The gateway retried a prefill (its worker died) with a fresh reservation for the same
    request: the dead writer's last push, refused under its old fence, does not fail the new
    reservation, whose own writer then fills it and the request decodes."""
    stack, stub, sender, peer = setup
    old = _reserve(stub, "late-1")
    _abort(stub, "late-1")
    fresh = _reserve(stub, "late-1")
    assert fresh.fence > old.fence
    # The worst case: the old writer's blocks are the fresh reservation's, none landed yet.
    stale = _push(sender, peer, "late-1", old.fence, fresh.block_ids, old.capability)
    if sender.name == "grpc":
        assert stale is not None and stale.status == "FAILED_PRECONDITION"
    else:
        assert stale is None  # landed one-sided; the notification is refused
    assert _push(sender, peer, "late-1", fresh.fence, fresh.block_ids, fresh.capability) is None
    replies = list(
        stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="late-1",
                sampling=convert.sampling_to_proto(GREEDY),
                first_tokens=[worker_pb2.FirstToken(index=0, token_id=7)],
            ),
            timeout=30,
        )
    )
    assert replies[-1].WhichOneof("kind") == "finished"
    assert replies[-1].finished.usage.completion_tokens == GREEDY.max_tokens
    assert_nothing_leaks(stack)


def test_a_push_for_an_unknown_request_is_refused(setup):
    stack, stub, sender, peer = setup
    dest = _reserve(stub, "known-1")  # real blocks to aim at, under another request's id
    refused = _push(sender, peer, "unknown-1", dest.fence, dest.block_ids)
    if sender.name == "grpc":
        assert refused is not None and refused.status == "NOT_FOUND"
    else:
        assert refused is None  # landed one-sided; the notification is refused
    assert _decode(stub, "unknown-1").code() == grpc.StatusCode.NOT_FOUND
    _abort(stub, "known-1")
    assert_nothing_leaks(stack)


@pytest.mark.parametrize("capability", [b"", b"guessed-capabil!"])
def test_a_push_without_the_reservations_capability_is_refused(setup, capability):
    """The right request, fence and blocks are not enough: the push must carry the token minted
    with the reservation (only the prefill worker chosen for it is handed that)."""
    stack, stub, sender, peer = setup
    dest = _reserve(stub, "cap-1")
    assert len(dest.capability) == 16 and dest.capability != capability
    refused = _push(sender, peer, "cap-1", dest.fence, dest.block_ids, capability)
    if sender.name == "grpc":
        assert refused is not None and refused.status == "PERMISSION_DENIED"
        assert "capability" in str(refused)
        _abort(stub, "cap-1")
    else:
        assert refused is None  # landed one-sided; the notification is refused
        err = _decode(stub, "cap-1")
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "capability" in err.details()
    assert_nothing_leaks(stack)


def test_a_prefill_whose_destination_published_no_endpoint_fails_aborted(setup):
    """The destination is unreachable, not the prefill worker: ABORTED, which the gateway
    retries with a fresh reservation without writing this prefill worker off (UNAVAILABLE
    would, and with it the only prefill worker: "no prefill worker is alive")."""
    stack, _, sender, _ = setup
    (prefill,) = [w for w in workers(stack) if w.kind == "prefill" and w.worker_id != "rogue"]
    registry = Registry(stack.redis_url)
    try:
        # NOTE: blocks reserved on a worker whose endpoint is not in the registry (none here)
        res = registry.reserve("no-endpoint-1", "ghost", [0, 1, 2, 3], lease_s=30)
        dest = worker_pb2.KVDestination(
            worker_id="ghost", address="127.0.0.1:9", block_ids=res.block_ids,
            fence=res.fence, kv_transports=[sender.name],
        )  # fmt: skip
        request = worker_pb2.PrefillRequest(
            request_id="no-endpoint-1",
            prompt_token_ids=PROMPT,
            sampling=convert.sampling_to_proto(GREEDY),
            destination=dest,
        )
        with grpc.insecure_channel(prefill.address) as channel, pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.ABORTED
        # NOTE: over gRPC too: a worker that names its transports has a receiver of its own,
        # so a missing record is a lapse, never a cue to push to its front's address
        assert f"ghost published no {sender.name} endpoint" in err.value.details()
        registry.release("no-endpoint-1")
    finally:
        registry.close()
    assert_nothing_leaks(stack)
