"""Span attributes: OpenTelemetry's GenAI semantic conventions, and splitserve's own.

Every service sets the request attributes on its request span, so each part of a trace can be
read on its own; the gateway's span also carries usage, finish reasons and time to first token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from splitserve.engine.outputs import SpeculationUsage
from splitserve.engine.sampling_params import SamplingParams
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2

OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"

REQUEST_ID = "splitserve.request_id"
WORKER_ID = "splitserve.worker_id"
KV_BYTES = "splitserve.kv.bytes"
KV_NUM_BLOCKS = "splitserve.kv.num_blocks"
KV_TRANSFER_SECONDS = "splitserve.kv.transfer_seconds"
# A request's speculative decoding on the worker that decoded it, named as the `spec_decode_*`
# metrics (set only when some of its drafts were verified).
SPEC_NUM_DRAFTS = "splitserve.spec_decode.num_drafts"
SPEC_NUM_DRAFT_TOKENS = "splitserve.spec_decode.num_draft_tokens"
SPEC_NUM_ACCEPTED_TOKENS = "splitserve.spec_decode.num_accepted_tokens"
SPEC_MEAN_ACCEPTANCE_LENGTH = "splitserve.spec_decode.mean_acceptance_length"

OPERATION_NAME = "text_completion"
PROVIDER_NAME = "splitserve"
_REASON_NAMES = {value: name for name, value in convert.FINISH_REASONS.items()}


def request_attributes(
    model: str, request_id: str, params: SamplingParams, num_prompt_tokens: int
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        OPERATION: OPERATION_NAME,
        PROVIDER: PROVIDER_NAME,
        REQUEST_MODEL: model,
        REQUEST_ID: request_id,
        REQUEST_MAX_TOKENS: params.max_tokens,
        REQUEST_TEMPERATURE: params.temperature,
        REQUEST_TOP_P: params.top_p,
        USAGE_INPUT_TOKENS: num_prompt_tokens,
    }
    if params.top_k > 0:
        attributes[REQUEST_TOP_K] = params.top_k
    if params.n != 1:
        attributes[REQUEST_CHOICE_COUNT] = params.n
    return attributes


def finish_reason_names(samples: Iterable[common_pb2.SampleFinish]) -> list[str]:
    """ "stop", "length" or "abort" for each sample, in sample order."""
    ordered = sorted(samples, key=lambda s: s.index)
    return [_REASON_NAMES.get(s.finish_reason, "unknown") for s in ordered]


def usage_attributes(
    usage: common_pb2.Usage, samples: Iterable[common_pb2.SampleFinish]
) -> dict[str, Any]:
    return {
        USAGE_INPUT_TOKENS: usage.prompt_tokens,
        USAGE_OUTPUT_TOKENS: usage.completion_tokens,
        USAGE_CACHED_INPUT_TOKENS: usage.cached_prompt_tokens,
        RESPONSE_FINISH_REASONS: finish_reason_names(samples),
    }


def speculation_attributes(usage: SpeculationUsage) -> dict[str, Any]:
    """The speculation one request saw: verifications, drafts proposed and accepted, and the
    mean acceptance length (1 + accepted / verifications: tokens per verifying step)."""
    return {
        SPEC_NUM_DRAFTS: usage.num_drafts,
        SPEC_NUM_DRAFT_TOKENS: usage.num_draft_tokens,
        SPEC_NUM_ACCEPTED_TOKENS: usage.num_accepted_tokens,
        SPEC_MEAN_ACCEPTANCE_LENGTH: usage.mean_acceptance_length,
    }
