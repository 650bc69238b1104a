"""A worker's record carries its tensor-parallel degree (and its loop's pace, which gateways
pace their deadlines by), and the gateway pairs a prefill worker with a decode worker only when
a KV transport serves both (a worker at TP > 1 offers gRPC)."""

from __future__ import annotations

import dataclasses

from splitserve.kv_transfer.registry_records import WorkerInfo, can_transfer, worker_from_fields


def _info(kind: str, transports: tuple[str, ...], tp: int = 1) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"{kind}-0", kind=kind, address="127.0.0.1:1", block_size=16,
        kv_transports=transports, tensor_parallel_size=tp,
    )  # fmt: skip


def test_the_record_round_trips_the_tensor_parallel_degree():
    info = _info("decode", ("grpc",), tp=2)
    fields = {f.name: str(getattr(info, f.name)) for f in dataclasses.fields(info)}
    fields["kv_transports"], fields["adapters"] = "grpc", "[]"
    assert worker_from_fields(fields).tensor_parallel_size == 2
    del fields["tensor_parallel_size"]  # a record from before the field: one rank
    assert worker_from_fields(fields).tensor_parallel_size == 1


def test_the_record_round_trips_the_workers_pace():
    info = dataclasses.replace(_info("decode", ("grpc",)), pace_ms=850)
    fields = {f.name: str(getattr(info, f.name)) for f in dataclasses.fields(info)}
    fields["kv_transports"], fields["adapters"] = "grpc", "[]"
    assert worker_from_fields(fields).pace_ms == 850
    del fields["pace_ms"]  # a record from before the field: not known
    assert worker_from_fields(fields).pace_ms == 0


def test_a_tp2_prefill_worker_pairs_only_with_decode_workers_it_can_push_to():
    tp2_prefill = _info("prefill", ("grpc",), tp=2)  # NIXL refuses a sharded pool
    assert can_transfer(tp2_prefill, _info("decode", ("nixl", "grpc")))
    assert can_transfer(tp2_prefill, _info("decode", ("grpc",), tp=2))
    assert not can_transfer(tp2_prefill, _info("decode", ("nixl",)))
    # A worker that advertises nothing speaks gRPC.
    assert can_transfer(_info("prefill", ()), _info("decode", ("grpc",)))
