"""Turning a GenerateRequest into a validated job, or an InvalidRequest that names what is wrong."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from jinja2 import TemplateError

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.lora.request import check_adapter_name
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
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)


def validate_request(
    request: gateway_pb2.GenerateRequest, tokenizer, model: ModelConfig, max_model_len: int
) -> Job:
    """Check everything a worker would refuse, before any worker is involved."""
    params = convert.sampling_from_proto(request.sampling, model.generation_defaults)
    params.check_token_ids(model.vocab_size)
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("prompt is empty")
        prompt = list(tokenizer.encode(request.text, add_special_tokens=True))
    elif kind == "messages":
        prompt = render_chat(tokenizer, request.messages.messages)
        if not request.sampling.HasField("max_tokens"):  # a chat reply runs to the context's end
            params = dataclasses.replace(params, max_tokens=max(1, max_model_len - len(prompt)))
    elif kind == "token_ids":
        prompt = list(request.token_ids.ids)
        bad = [t for t in prompt if t >= model.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt has token ids outside the vocabulary [0, {model.vocab_size}): {bad[:5]}"
            )
    else:
        raise InvalidRequest("prompt is missing: set `text`, `token_ids` or `messages`")
    if not prompt:
        raise InvalidRequest("prompt is empty (no tokens)")
    if len(prompt) + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens"
        )
    request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
    adapter = check_adapter_name(request.adapter) if request.adapter else None
    return Job(request_id, prompt, params, request.priority, adapter)


def render_chat(tokenizer, messages: Iterable[gateway_pb2.ChatMessage]) -> list[int]:
    """Token ids of `messages` as the model's chat template renders them, with the assistant's
    generation prompt: `apply_chat_template(..., add_generation_prompt=True)`, as HF does."""
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    if not conversation:
        raise InvalidRequest("messages is empty")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "this model has no chat template (none in its tokenizer_config.json or "
            "chat_template.jinja); send a plain prompt instead"
        )
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except (TemplateError, ValueError, TypeError) as exc:  # a template that refuses them
        raise InvalidRequest(f"the chat template refused these messages: {exc}") from None
    # NOTE: the template writes any BOS itself; encoding adds no second one (HF does the same).
    return list(tokenizer.encode(text, add_special_tokens=False))
