"""A corrupted KV payload on the real path (gateway -> prefill -> push -> decode, real gRPC
servers and a real redis-server): the decode worker refuses it, the request fails cleanly with
the reason, nothing leaks, and the same workers then serve the next request."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.kv_transfer import transport
from splitserve.kv_transfer.grpc_transport import GrpcKVSender
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.transport import PushResult, TransportKind
from splitserve.launch.services import start_decode, start_gateway, start_prefill
from splitserve.protos.v1 import gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from splitserve.runtime.settings import GatewaySettings, ServiceSettings, WorkerSettings

pytestmark = pytest.mark.slow


class CorruptingSender(GrpcKVSender):
    """Flips one payload byte after the header (and its CRC) was made: a bit error in flight."""

    enabled = True

    def _send(self, address, header, payload, timeout_s, *args) -> PushResult:
        if self.enabled:
            damaged = bytearray(payload)
            damaged[len(damaged) // 2] ^= 0xFF
            payload = memoryview(damaged)
        return super()._send(address, header, payload, timeout_s, *args)


def _stats(address: str, stub_cls) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        return stub_cls(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def _corrupting_grpc() -> TransportKind:
    kind = transport._grpc()
    return TransportKind(
        sender=lambda connector, worker_id, cluster_secret="": CorruptingSender(
            connector, cluster_secret=cluster_secret
        ),
        receiver=kind.receiver,
    )


def test_corrupted_payload_fails_the_request_cleanly_and_workers_keep_serving(
    tiny_models, monkeypatch
):
    model = str(tiny_models["llama"])
    # NOTE: the engine core runs in this process (a thread), so its gRPC sender is ours.
    monkeypatch.setitem(transport.TRANSPORTS, "grpc", _corrupting_grpc)
    monkeypatch.setattr(CorruptingSender, "enabled", True)
    worker = WorkerSettings(
        num_kv_blocks=128,
        lease_s=3.0,
        heartbeat_ttl_s=1.5,
        kv_transport="grpc",
        engine_core="thread",
    )
    with RedisServer() as redis:
        service = ServiceSettings(model=model, redis_url=redis.url)
        decode = start_decode(replace(service, worker_id="d0"), worker)
        prefill = start_prefill(replace(service, worker_id="p0"), worker)
        gateway = start_gateway(service, GatewaySettings())
        try:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            with grpc.insecure_channel(gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    collect(stream(stub, list(range(5, 60)), params, timeout_s=60))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "checksum" in err.value.details()

                monkeypatch.setattr(CorruptingSender, "enabled", False)
                done = collect(stream(stub, list(range(5, 60)), params, timeout_s=60))
                assert len(done.token_ids[0]) == 8
            d = _stats(decode.address, worker_pb2_grpc.DecodeWorkerStub)
            p = _stats(prefill.address, worker_pb2_grpc.PrefillWorkerStub)
            for s in (d, p):
                assert s.num_free_blocks == s.num_total_blocks and s.num_requests == 0
            assert d.num_reservations == 0
            registry = Registry(redis.url)
            assert registry.request_record_keys() == []
            registry.close()
        finally:
            gateway.stop()
            prefill.stop()
            decode.stop()
