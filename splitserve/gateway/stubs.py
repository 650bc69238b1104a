"""Channels from the gateway to the workers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import grpc

from splitserve.gateway.decode_many import DecodeMuxes
from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc


class Stubs:
    """One `grpc.aio` channel per worker address, shared by all requests (made and used on the
    server's event loop); with `decode_many`, one DecodeMany call per decode worker carries
    every Decode stream to it (`decode_many.py`)."""

    def __init__(
        self, interceptors: Sequence[grpc.aio.ClientInterceptor] = (), decode_many: bool = False
    ) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._interceptors = list(interceptors)  # e.g. the cluster secret on every call
        self._lock = threading.Lock()
        self._muxes = DecodeMuxes() if decode_many else None

    def channel(self, address: str) -> grpc.aio.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.aio.insecure_channel(
                    address, interceptors=self._interceptors or None
                )
            return self._channels[address]

    @property
    def joins(self) -> bool:
        """A Decode stream's read returns what queued up for one sample as one message
        (DecodeMany streams do; a call of its own hands over one message per read, as do the
        streams to a worker without DecodeMany, whose behind handlers then wait for nothing)."""
        return self._muxes is not None

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(address))

    def decode_stream(
        self,
        address: str,
        request: worker_pb2.DecodeRequest,
        timeout: float | None,
        metadata: Any,
    ) -> Any:
        """A Decode stream to the worker at `address`: a call of its own, or one stream on the
        process's DecodeMany call to it; either is read, cancelled and fails the same way."""
        if self._muxes is None:
            return self.decode(address).Decode(request, timeout=timeout, metadata=metadata)
        return self._muxes.open(self.decode, address, request, timeout, metadata)

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(address))

    async def close(self) -> None:
        if self._muxes is not None:
            self._muxes.close()
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            await channel.close()
