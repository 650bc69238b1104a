"""What crosses between a worker's front process and its engine core: msgpack over ZMQ.

Commands (front -> core) are `[call_id, method, args]` from a closed vocabulary (each role's
handler lists its methods); the core answers on one ordered event stream (core -> front):

    ["ready", info]                      once, when the engine is loaded and the transports up
    ["reply", call_id, True, result]     a command's result ...
    ["reply", call_id, False, [kind, message, status]]   ... or the error it raised
    ["step", entries]                    every request that gained tokens in one engine step
    ["progress", {request_id: n}]        prompt tokens computed so far (prefill spans)
    ["kv", num_bytes, seconds, ok]       one KV push sent or received (transfer metrics)
    ["failed", message]                  the engine loop died

A step entry is `[request_id, finished, num_cached_tokens, samples, speculation]`, a sample
`[index, new_token_ids, new_logprobs, finish_reason, stop_reason, text_len]`: only the tokens
since the previous entry of that request travel (the front keeps the cumulative output).
`speculation` is the request's cumulative `[num_drafts, num_draft_tokens, num_accepted_tokens]`
(engine/outputs.py `SpeculationUsage`), or None while it has none.
NOTE: nothing is pickled: sampling parameters and KV destinations travel as their protobuf
bytes, errors as a kind from `ERRORS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack

from splitserve.engine.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    Overloaded,
    SplitserveError,
    Unavailable,
)
from splitserve.engine.outputs import (
    CompletionOutput,
    RequestOutput,
    SampledToken,
    SpeculationUsage,
)
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv_transfer.registry_conceal import Concealed
from splitserve.kv_transfer.transport import PushRefused, TransferError
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine

STOP = "__stop__"
"""The call that stops the core (its main thread leaves its loop)."""

ERRORS: dict[str, type[SplitserveError]] = {
    cls.__name__: cls
    for cls in (
        InvalidRequest, NotFound, FailedPrecondition, Overloaded, Unavailable, Cancelled,
        DeadlineExceeded, AlreadyExists,
    )
}  # fmt: skip


class CoreError(SplitserveError):
    """An error inside the engine core that is none of the domain errors (INTERNAL)."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def error_to_wire(exc: BaseException) -> list[Any]:
    """`[kind, message, status]` of an exception raised by a command."""
    if isinstance(exc, TransferError):
        return ["TransferError", str(exc), exc.status]
    if isinstance(exc, PushRefused):
        return ["PushRefused", str(exc), exc.status]
    for name, cls in ERRORS.items():
        if type(exc) is cls:
            return [name, str(exc), ""]
    for name, cls in ERRORS.items():  # a subclass (e.g. CapacityError) travels as its base
        if isinstance(exc, cls):
            return [name, str(exc), ""]
    return ["CoreError", f"{type(exc).__name__}: {exc}", ""]


def error_from_wire(kind: str, message: str, status: str) -> SplitserveError:
    if kind == "TransferError":
        return TransferError(message, status)
    if kind == "PushRefused":
        return PushRefused(status, message)
    return ERRORS.get(kind, CoreError)(message)


class StepEncoder:
    """Core side: turns the engine's cumulative `RequestOutput`s into step entries that carry
    only what is new since the request's previous entry."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, int]] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[list[Any]]:
        entries = []
        for out in outputs:
            sent = self._sent.setdefault(out.request_id, {})
            samples = []
            for s in out.outputs:
                start = sent.get(s.index, 0)
                new_logprobs = None
                if s.logprobs is not None:
                    new_logprobs = [list(d.items()) for d in s.logprobs[start:]]
                sent[s.index] = len(s.token_ids)
                # NOTE: the engine cut a matched stop string out of its text; the front cuts
                # its own text (the same tokens, decoded the same way) to this length.
                text_len = len(s.text) if isinstance(s.stop_reason, str) else None
                samples.append(
                    [s.index, s.token_ids[start:], new_logprobs, s.finish_reason,
                     s.stop_reason, text_len]
                )  # fmt: skip
            entries.append(
                [out.request_id, out.finished, out.num_cached_tokens, samples,
                 speculation_to_wire(out.speculation)]
            )  # fmt: skip
            if out.finished:
                del self._sent[out.request_id]
        return entries

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def output_from_entry(entry: list[Any], prompt_token_ids: list[int]) -> RequestOutput:
    """A whole output sent as one entry (a prefill's first tokens), without text."""
    request_id, finished, num_cached, samples, speculation = entry
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=index,
                text="",
                token_ids=list(tokens),
                finish_reason=reason,
                stop_reason=stop,
                logprobs=None if lps is None else [dict(map(tuple, d)) for d in lps],
            )
            for index, tokens, lps, reason, stop, _ in samples
        ],
        finished=finished,
        num_cached_tokens=num_cached,
        speculation=speculation_from_wire(speculation),
    )


def speculation_to_wire(usage: SpeculationUsage | None) -> list[int] | None:
    if usage is None:
        return None
    return [usage.num_drafts, usage.num_draft_tokens, usage.num_accepted_tokens]


def speculation_from_wire(items: list[int] | None) -> SpeculationUsage | None:
    return None if items is None else SpeculationUsage(*items)


def params_to_wire(params: SamplingParams) -> bytes:
    return convert.sampling_to_proto(params).SerializeToString()


def params_from_wire(data: bytes) -> SamplingParams:
    return convert.sampling_from_proto(common_pb2.SamplingParams.FromString(data))


def first_tokens_to_wire(tokens: list[SampledToken]) -> list[Any]:
    return [[t.token_id, None if t.logprobs is None else list(t.logprobs.items())] for t in tokens]


def first_tokens_from_wire(items: list[Any]) -> list[SampledToken]:
    return [
        SampledToken(token_id, None if lps is None else dict(map(tuple, lps)))
        for token_id, lps in items
    ]


def engine_limits(engine: LLMEngine) -> dict[str, Any]:
    """What a worker's registry record and the gateway's checks need of its engine."""
    config = engine.config
    return {
        "block_size": config.block_size,
        "num_kv_blocks": config.num_kv_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_model_len": engine.max_model_len,
        "kv_dtype": str(config.cache_dtype).removeprefix("torch."),
        "tensor_parallel_size": config.tensor_parallel_size,
    }


def endpoint_to_wire(endpoint: dict[str, bytes]) -> list[list[Any]]:
    """A transport endpoint as `[name, value, concealed]` triples: msgpack would make a
    `Concealed` value plain bytes, and the registry would then store it unencrypted."""
    return [[k, bytes(v), isinstance(v, Concealed)] for k, v in endpoint.items()]


def endpoint_from_wire(items: list[list[Any]]) -> dict[str, bytes]:
    return {k: Concealed(v) if concealed else v for k, v, concealed in items}
