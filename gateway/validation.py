"""Turning a GenerateRequest into a validated job, or an InvalidRequest that names what is wrong."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.sampling_params import SamplingParams
from splitserve.protos import convert
from splitserve.protos.v1 import gateway_pb2


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


def validate_request(
    request: gateway_pb2.GenerateRequest, tokenizer, model: ModelConfig, max_model_len: int
) -> Job:
    """Check everything a worker would refuse, before any worker is involved."""
    params = convert.sampling_from_proto(request.sampling)
    params.check_token_ids(model.vocab_size)
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("prompt is empty")
        prompt = list(tokenizer.encode(request.text, add_special_tokens=False))
    elif kind == "token_ids":
        prompt = list(request.token_ids.ids)
        bad = [t for t in prompt if t >= model.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt has token ids outside the vocabulary [0, {model.vocab_size}): {bad[:5]}"
            )
    else:
        raise InvalidRequest("prompt is missing: set `text` or `token_ids`")
    if not prompt:
        raise InvalidRequest("prompt is empty (no tokens)")
    if len(prompt) + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens"
        )
    request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
    return Job(request_id, prompt, params, request.priority)
