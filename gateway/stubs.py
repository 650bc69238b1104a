"""Channels from the gateway to the workers."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from splitserve.protos.v1 import worker_pb2_grpc


class Stubs:
    """One `grpc.aio` channel per worker address, shared by all requests (made and used on the
    server's event loop)."""

    def __init__(self, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._interceptors = list(interceptors)  # e.g. the cluster secret on every call
        self._lock = threading.Lock()

    def channel(self, address: str) -> grpc.aio.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.aio.insecure_channel(
                    address, interceptors=self._interceptors or None
                )
            return self._channels[address]

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(address))

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(address))

    async def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            await channel.close()
