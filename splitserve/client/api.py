"""A small client of the public API, used by `splitserve generate` and the tests."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator, Sequence
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
    chat: bool = False,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> Iterator[gateway_pb2.GenerateResponse]:
    """Send one request; `chat` sends a text prompt as one user message, which the gateway
    renders with the model's chat template (what an instruction-tuned model answers). With an
    asyncio stub (`grpc.aio`) it returns the call to iterate with `async for`."""
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, sampling=convert.sampling_to_proto(params or SamplingParams())
    )
    if isinstance(prompt, str) and chat:
        request.messages.messages.add(role="user", content=prompt)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return stub.Generate(request, timeout=timeout_s, metadata=metadata)


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


def connect(
    address: str, api_key: str | None = None, root_certificates: bytes | None = None
) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayStub]:
    """A channel to a gateway: TLS when given the CA's `root_certificates` (PEM), and every
    call carrying `authorization: Bearer <api_key>` when given a key."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
        if root_certificates is not None
        else grpc.insecure_channel(address)
    )
    if api_key:
        channel = grpc.intercept_channel(channel, BearerKey(api_key))
    return channel, gateway_pb2_grpc.GatewayStub(channel)


class BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call."""

    def __init__(self, key: str) -> None:
        self._pair = ("authorization", f"Bearer {key}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), self._pair),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _CallDetails(
    namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass
