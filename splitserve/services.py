"""Starting each kind of service in this process: decode (or colocated), prefill, gateway."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from decode_service.receiver import ReservationReceiver
from decode_service.servicer import DecodeServicer
from decode_service.worker import DecodeSettings, DecodeWorker
from engine.config import EngineConfig, ModelConfig, parse_dtype, resolve_device
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.tokenizer import load_tokenizer
from gateway.orchestrator import Orchestrator, OrchestratorSettings
from gateway.router import make_policy
from gateway.servicer import GatewayServicer, ModelInfo
from kv_transfer.grpc_transport import KVTransferServicer
from kv_transfer.presence import Presence
from kv_transfer.registry import Registry, WorkerInfo
from kv_transfer.transport import get_transport
from prefill_service.servicer import PrefillServicer
from prefill_service.worker import PrefillSettings, PrefillWorker
from protos.v1 import gateway_pb2_grpc, kv_transfer_pb2_grpc, worker_pb2_grpc
from splitserve.grpc_server import Server, start_server
from splitserve.settings import GatewaySettings, ServiceSettings, WorkerSettings

log = logging.getLogger(__name__)

GATEWAY_SERVICE = "splitserve.v1.Gateway"
PREFILL_SERVICE = "splitserve.v1.PrefillWorker"
DECODE_SERVICE = "splitserve.v1.DecodeWorker"
KV_SERVICE = "splitserve.v1.KVTransfer"


@dataclass
class Running:
    """A started service: where it listens, and how to stop it."""

    server: Server
    address: str
    stop: Callable[[], None]
    worker: object = None


def _engine(
    service: ServiceSettings, worker: WorkerSettings, record_prefix_events: bool = False
) -> LLMEngine:
    device = resolve_device(worker.device)
    config = EngineConfig(
        record_prefix_events=record_prefix_events,
        dtype=parse_dtype(worker.dtype, device),
        device=device,
        block_size=worker.block_size,
        num_kv_blocks=worker.num_kv_blocks,
        kv_cache_memory_bytes=worker.kv_cache_memory_bytes,
        max_num_batched_tokens=worker.max_num_batched_tokens,
        max_num_seqs=worker.max_num_seqs,
    )
    return LLMEngine(service.model, config)


def _worker_info(kind: str, worker_id: str, address: str, engine: LLMEngine, extra_load: int):
    usage = engine.kv_usage()
    load = len(engine.scheduler.running) + len(engine.scheduler.waiting) + extra_load
    return WorkerInfo(
        worker_id=worker_id,
        kind=kind,
        address=address,
        load=load,
        num_free_blocks=usage.num_free_blocks + usage.num_cached_blocks,
        num_total_blocks=usage.num_total_blocks,
    )


def start_decode(service: ServiceSettings, worker: WorkerSettings, kind: str = "decode") -> Running:
    """A decode worker (kind "decode"), or a colocated one that also prefills ("colocated")."""
    engine = _engine(service, worker, record_prefix_events=True)
    loop = EngineLoop(engine).start()
    registry = Registry(service.redis_url)
    decode = DecodeWorker(
        loop,
        registry,
        DecodeSettings(worker_id=service.worker_id, address="", lease_s=worker.lease_s),
    )
    receiver = ReservationReceiver(engine.runner.kv_caches, decode.reservations)

    def register(server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(decode, receiver), server)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver), server)

    server = start_server(register, [DECODE_SERVICE, KV_SERVICE], service.host, service.port)
    address = f"{service.public_host}:{server.port}"
    decode.settings = dataclasses.replace(decode.settings, address=address)
    presence = Presence(
        registry,
        lambda: _worker_info(kind, service.worker_id, address, engine, len(decode.reservations)),
        ttl_s=worker.heartbeat_ttl_s,
        interval_s=worker.heartbeat_ttl_s / 6,
        on_tick=decode.housekeeping,
    ).start()
    server.set_serving(True, ["", DECODE_SERVICE, KV_SERVICE])

    def stop() -> None:
        server.set_serving(False, ["", DECODE_SERVICE, KV_SERVICE])
        presence.stop()
        decode.leave_prefix_index()
        server.stop()
        loop.stop()
        registry.close()

    return Running(server, address, stop, decode)


def start_prefill(service: ServiceSettings, worker: WorkerSettings) -> Running:
    engine = _engine(service, worker)
    loop = EngineLoop(engine).start()
    registry = Registry(service.redis_url)
    transport = get_transport("grpc")
    prefill = PrefillWorker(
        loop, registry, transport, PrefillSettings(service.worker_id, lease_s=worker.lease_s)
    )
    server = start_server(
        lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(prefill), s),
        [PREFILL_SERVICE],
        service.host,
        service.port,
    )
    address = f"{service.public_host}:{server.port}"
    presence = Presence(
        registry,
        lambda: _worker_info("prefill", service.worker_id, address, engine, 0),
        ttl_s=worker.heartbeat_ttl_s,
        interval_s=worker.heartbeat_ttl_s / 6,
    ).start()
    server.set_serving(True, ["", PREFILL_SERVICE])

    def stop() -> None:
        server.set_serving(False, ["", PREFILL_SERVICE])
        presence.stop()
        server.stop()
        prefill.close()
        transport.close()
        loop.stop()
        registry.close()

    return Running(server, address, stop, prefill)


def start_gateway(service: ServiceSettings, gateway: GatewaySettings) -> Running:
    model_config = ModelConfig.from_pretrained(service.model)
    tokenizer = load_tokenizer(service.model)
    registry = Registry(service.redis_url)
    orchestrator = Orchestrator(
        registry,
        make_policy(gateway.routing_policy),
        OrchestratorSettings(
            block_size=gateway.block_size,
            local_prefill_tokens=gateway.local_prefill_tokens,
            default_timeout_s=gateway.request_timeout_s,
        ),
    )
    info = ModelInfo(
        name=gateway.model_name or service.model.rstrip("/").rsplit("/", 1)[-1],
        config=model_config,
        max_model_len=model_config.max_model_len,
        block_size=gateway.block_size,
    )
    servicer = GatewayServicer(orchestrator, tokenizer, info, gateway.max_inflight)
    server = start_server(
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
        [GATEWAY_SERVICE],
        service.host,
        service.port,
        max_workers=gateway.max_inflight + 16,
    )
    server.set_serving(True, ["", GATEWAY_SERVICE])

    def stop() -> None:
        server.set_serving(False, ["", GATEWAY_SERVICE])
        server.stop()
        orchestrator.close()
        registry.close()

    return Running(server, f"{service.public_host}:{server.port}", stop, orchestrator)
