"""A small client of the public API, used by `splitserve generate` and the tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from splitserve.engine.sampling_params import SamplingParams
from splitserve.protos import convert
from splitserve.protos.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass
class Completion:
    """A whole streamed reply, put back together."""

    request_id: str = ""
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finished: gateway_pb2.Finished | None = None


def stream(
    stub: gateway_pb2_grpc.GatewayStub,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    request_id: str = "",
    timeout_s: float | None = None,
) -> Iterator[gateway_pb2.GenerateResponse]:
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, sampling=convert.sampling_to_proto(params or SamplingParams())
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return stub.Generate(request, timeout=timeout_s)


def collect(responses: Iterator[gateway_pb2.GenerateResponse]) -> Completion:
    done = Completion()
    for msg in responses:
        done.request_id = msg.request_id
        if msg.HasField("chunk"):
            chunk = msg.chunk
            done.token_ids.setdefault(chunk.index, []).extend(chunk.token_ids)
            done.text[chunk.index] = done.text.get(chunk.index, "") + chunk.text
        else:
            done.finished = msg.finished
    return done


def connect(address: str) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayStub]:
    channel = grpc.insecure_channel(address)
    return channel, gateway_pb2_grpc.GatewayStub(channel)
