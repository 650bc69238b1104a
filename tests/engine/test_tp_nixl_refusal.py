"""NIXL and tensor parallelism: NIXL writes whole blocks into one registered pool, and a TP > 1
worker's pool holds only rank 0's KV heads, so naming NIXL fails the worker with an error that
says why and what to use; `auto` leaves NIXL out and sends over gRPC."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM
from splitserve.launch.kv_transports import start_senders

pytestmark = pytest.mark.slow


def test_nixl_refuses_a_tensor_parallel_pool_and_auto_falls_back_to_grpc(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, num_kv_blocks=32)
    try:
        connector = llm.engine.kv_connector
        assert not connector.region().addressable
        with pytest.raises(RuntimeError, match=r"nixl could not start: .*--kv-transport grpc"):
            start_senders("nixl", connector, "prefill-0")
        senders = start_senders("auto", connector, "prefill-0")
        try:
            assert list(senders) == ["grpc"]
        finally:
            for sender in senders.values():
                sender.close()
    finally:
        llm.engine.shutdown()
