"""Senders: one request out, its timings back. `grpc` speaks splitserve's gateway API; `openai`
speaks any OpenAI-compatible server's streaming `/v1/completions` (server-sent events). Both
send the prompt as text and ask for greedy sampling, and, unless told otherwise, `ignore_eos`
(so each reply is as long as asked: vLLM's and splitserve's servers honour it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import httpx

from splitserve.client.api import stream
from splitserve.client.bench.metrics import RequestResult
from splitserve.engine.sampling_params import SamplingParams
from splitserve.protos.v1 import gateway_pb2_grpc

CONNECT_WAIT_S = 10.0
GRPC_CHANNELS = 4  # connections per client process (a gateway's processes share its port per
# connection, SO_REUSEPORT: one connection would reach one of them only)


@dataclass(frozen=True)
class Target:
    """Where and how to send (picklable: each client process opens its own sender)."""

    backend: str  # "grpc" or "openai"
    address: str = ""  # gRPC host:port
    base_url: str = ""  # HTTP server root, e.g. http://127.0.0.1:8000
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    tls_ca_file: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0


class Sender(Protocol):
    async def connect(self) -> None: ...

    async def send(self, prompt: str, max_tokens: int) -> RequestResult: ...

    async def close(self) -> None: ...


def _fill_input(result: RequestResult, prompt: str) -> RequestResult:
    if not result.input_tokens:  # the server did not say: the prompt's words (datasets.py)
        result.input_tokens = len(prompt.split())
    return result


class GrpcSender:
    def __init__(self, target: Target) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]
        if target.tls_ca_file:
            creds = grpc.ssl_channel_credentials(Path(target.tls_ca_file).read_bytes())
            self._channels = [
                grpc.aio.secure_channel(target.address, creds, options=options)
                for _ in range(GRPC_CHANNELS)
            ]
        else:
            self._channels = [
                grpc.aio.insecure_channel(target.address, options=options)
                for _ in range(GRPC_CHANNELS)
            ]
        self._stubs = [gateway_pb2_grpc.GatewayStub(c) for c in self._channels]
        self._metadata = (
            (("authorization", f"Bearer {target.api_key}"),) if target.api_key else None
        )
        self._target, self._next = target, 0

    async def connect(self) -> None:
        """Every channel connected, or CONNECT_WAIT_S gone by (each request then fails and
        says why)."""
        ready = asyncio.gather(*(_connected(c) for c in self._channels))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ready, CONNECT_WAIT_S)

    async def send(self, prompt: str, max_tokens: int) -> RequestResult:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=self._target.ignore_eos
        )
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        result, texts, last = RequestResult(sent=time.monotonic()), [], 0.0
        call: Any = stream(
            stub, prompt, params, timeout_s=self._target.timeout_s, metadata=self._metadata
        )
        try:
            async for msg in call:
                if msg.HasField("chunk"):
                    if not msg.chunk.token_ids:
                        continue
                    now = time.monotonic()
                    if not result.output_tokens:
                        result.ttft = now - result.sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.output_tokens += len(msg.chunk.token_ids)
                    texts.append(msg.chunk.text)
                else:
                    result.input_tokens = msg.finished.usage.prompt_tokens
        except grpc.RpcError as exc:
            code = exc.code().name  # type: ignore[attr-defined]
            result.error = f"{code}: {(exc.details() or '')[:200]}"  # type: ignore[attr-defined]
        result.latency = (last or time.monotonic()) - result.sent
        result.text = "".join(texts)
        result.success = not result.error and result.output_tokens > 0
        if not result.error and not result.success:
            result.error = "no tokens streamed"
        return _fill_input(result, prompt)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


async def _connected(channel: grpc.aio.Channel) -> None:
    """Until the channel is READY, or has failed to connect once (TRANSIENT_FAILURE)."""
    state = channel.get_state(try_to_connect=True)
    while state not in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)


class OpenAISender:
    def __init__(self, target: Target) -> None:
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=target.base_url,
            headers=headers,
            timeout=httpx.Timeout(target.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            verify=target.tls_ca_file or True,
        )
        self._target = target

    async def connect(self) -> None:
        """NOTE: httpx opens a connection per concurrent request, on first use; one is opened
        here (and the server seen to answer), the rest as vLLM's client opens them."""
        with contextlib.suppress(httpx.HTTPError):  # NOTE: each request says what is wrong
            await self._client.get("/v1/models")

    async def send(self, prompt: str, max_tokens: int) -> RequestResult:
        body: dict[str, Any] = {
            "model": self._target.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._target.ignore_eos:
            body["ignore_eos"] = True
        result, texts, last = RequestResult(sent=time.monotonic()), [], 0.0
        chunks, completion_tokens = 0, 0
        try:
            async with self._client.stream("POST", self._target.endpoint, json=body) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    result.error = f"HTTP {reply.status_code}: {text[:200]}"
                else:
                    async for line in reply.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        event = json.loads(data)
                        if usage := event.get("usage"):
                            result.input_tokens = int(usage.get("prompt_tokens") or 0)
                            completion_tokens = int(usage.get("completion_tokens") or 0)
                        choices = event.get("choices") or []
                        if not choices or not choices[0].get("text"):
                            continue
                        now = time.monotonic()
                        if not chunks:
                            result.ttft = now - result.sent
                        else:
                            result.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        texts.append(choices[0]["text"])
        except (httpx.HTTPError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        result.latency = (last or time.monotonic()) - result.sent
        result.text = "".join(texts)
        # NOTE: without usage, one chunk is counted as one token (what most servers stream)
        result.output_tokens = completion_tokens or chunks
        result.success = not result.error and chunks > 0
        if not result.error and not result.success:
            result.error = "no text streamed"
        return _fill_input(result, prompt)

    async def close(self) -> None:
        await self._client.aclose()


def open_sender(target: Target) -> Sender:
    return GrpcSender(target) if target.backend == "grpc" else OpenAISender(target)


def served_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The first model an OpenAI-compatible server lists (GET /v1/models), for `--model`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout_s)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(
            f"cannot list the models at {base_url}/v1/models ({exc}); pass --model"
        ) from None
