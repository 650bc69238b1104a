"""Between protobuf messages and engine objects. Servicers call these and nothing else does."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.outputs import RequestOutput, Resume, SampledToken
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.stats import EngineStats
from splitserve.engine.structured import StructuredOutput
from splitserve.protos.v1 import common_pb2, worker_pb2

_OPTIONAL_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
)

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(
    msg: common_pb2.SamplingParams, defaults: Iterable[tuple[str, Any]] = ()
) -> SamplingParams:
    """Unset optional fields take `defaults` (the model's generation_config.json), then
    SamplingParams' own; bad values raise ValueError."""
    kwargs: dict[str, Any] = dict(defaults)
    kwargs.update({name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)})
    if "temperature" in kwargs:
        # float32 on the wire: 0.7 arrives as 0.699999988; round to what the client meant.
        kwargs["temperature"] = round(kwargs["temperature"], 6)
    kwargs["stop"] = tuple(msg.stop)
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["structured"] = structured_from_proto(msg)
    return SamplingParams(**kwargs)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop=list(params.stop), stop_token_ids=params.stop_token_ids)
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    structured_to_proto(params.structured, msg)
    return msg


def structured_from_proto(msg: common_pb2.SamplingParams) -> StructuredOutput | None:
    """The `structured` oneof as a spec (validated: a bad one raises InvalidRequest)."""
    kind = msg.WhichOneof("structured")
    if kind == "json_schema":
        return StructuredOutput(json_schema=msg.json_schema)
    if kind == "regex":
        return StructuredOutput(regex=msg.regex)
    if kind == "choice":
        return StructuredOutput(choice=tuple(msg.choice.choices))
    if kind == "json_object" and msg.json_object:
        return StructuredOutput(json_object=True)
    return None


def structured_to_proto(spec: StructuredOutput | None, msg: common_pb2.SamplingParams) -> None:
    if spec is None:
        return
    if spec.json_schema is not None:
        msg.json_schema = spec.json_schema
    elif spec.regex is not None:
        msg.regex = spec.regex
    elif spec.choice is not None:
        msg.choice.choices.extend(spec.choice)
    else:
        msg.json_object = spec.json_object


def logprobs_to_proto(token_id: int, entry: dict[int, float]) -> common_pb2.TokenLogprobs:
    top = sorted(entry.items(), key=lambda kv: -kv[1])
    return common_pb2.TokenLogprobs(
        token_id=token_id,
        logprob=entry[token_id],
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> dict[int, float]:
    entry = {t.token_id: t.logprob for t in msg.top}
    entry[msg.token_id] = msg.logprob
    return entry


def first_tokens_to_proto(out: RequestOutput) -> list[worker_pb2.FirstToken]:
    tokens = []
    for sample in out.outputs:
        msg = worker_pb2.FirstToken(index=sample.index, token_id=sample.token_ids[0])
        if sample.logprobs:
            msg.logprobs.CopyFrom(logprobs_to_proto(sample.token_ids[0], sample.logprobs[0]))
        tokens.append(msg)
    return tokens


def first_tokens_from_proto(msgs: Any) -> list[SampledToken]:
    ordered = sorted(msgs, key=lambda m: m.index)
    return [
        SampledToken(
            m.token_id, logprobs_from_proto(m.logprobs) if m.HasField("logprobs") else None
        )
        for m in ordered
    ]


def join_delta(into: common_pb2.SampleDelta, more: common_pb2.SampleDelta) -> None:
    """Append `more` (the same sample's next delta) to `into`: token ids, text, logprobs."""
    into.token_ids.extend(more.token_ids)
    into.text += more.text
    if more.logprobs:
        into.logprobs.extend(more.logprobs)


@dataclass
class DeltaTracker:
    """Turns a request's cumulative outputs into per-sample deltas for streaming.

    NOTE: text that could still turn out to begin a stop string is held back until the sample
    finishes, because the engine cuts a matched stop string out of the text.
    """

    holdback: int = 0
    _sent_tokens: dict[int, int] = field(default_factory=dict)
    _sent_text: dict[int, int] = field(default_factory=dict)

    @classmethod
    def for_params(cls, params: SamplingParams) -> DeltaTracker:
        return cls(holdback=max((len(s) for s in params.stop), default=1) - 1)

    def resume_after(self, resume: worker_pb2.ResumeFrom) -> None:
        """Stream a resumed sample from where the client's stream broke off."""
        self._sent_tokens[resume.sample_index] = len(resume.output_token_ids)
        self._sent_text[resume.sample_index] = resume.num_text_chars

    def deltas(self, out: RequestOutput) -> list[common_pb2.SampleDelta]:
        result = []
        for sample in out.outputs:
            sent_t = self._sent_tokens.get(sample.index, 0)
            sent_x = self._sent_text.get(sample.index, 0)
            text_end = len(sample.text) if sample.finished else len(sample.text) - self.holdback
            text = sample.text[sent_x:text_end] if text_end > sent_x else ""
            new_tokens = sample.token_ids[sent_t:]
            if not new_tokens and not text:
                continue
            delta = common_pb2.SampleDelta(index=sample.index, token_ids=new_tokens, text=text)
            if sample.logprobs:
                for i, token_id in enumerate(new_tokens, start=sent_t):
                    delta.logprobs.append(logprobs_to_proto(token_id, sample.logprobs[i]))
            self._sent_tokens[sample.index] = len(sample.token_ids)
            self._sent_text[sample.index] = max(sent_x, text_end)
            result.append(delta)
        return result


def resume_from_proto(msg: worker_pb2.ResumeFrom) -> Resume:
    return Resume(msg.sample_index, tuple(msg.output_token_ids))


def finishes_to_proto(out: RequestOutput) -> list[common_pb2.SampleFinish]:
    finishes = []
    for sample in out.outputs:
        msg = common_pb2.SampleFinish(
            index=sample.index,
            finish_reason=FINISH_REASONS.get(sample.finish_reason or "")
            or common_pb2.FINISH_REASON_UNSPECIFIED,
        )
        if isinstance(sample.stop_reason, str):
            msg.stop_string = sample.stop_reason
        elif isinstance(sample.stop_reason, int):
            msg.stop_token_id = sample.stop_reason
        finishes.append(msg)
    return finishes


def usage_to_proto(out: RequestOutput) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(s.token_ids) for s in out.outputs),
        cached_prompt_tokens=out.num_cached_tokens,
    )


def stats_to_proto(stats: EngineStats, worker_id: str, **counters: int) -> worker_pb2.WorkerStats:
    """GetStats' answer: the engine's snapshot plus the service's own counters."""
    return worker_pb2.WorkerStats(
        worker_id=worker_id,
        num_total_blocks=stats.num_total_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_running=stats.num_requests_running,
        num_waiting=stats.num_requests_waiting,
        prefix_cache_hit_tokens=stats.prefix_cache_hits,
        num_requests=stats.num_requests,
        num_pinned_blocks=stats.num_pinned_blocks,
        block_size=stats.block_size,
        num_prefill_tokens=stats.num_prefill_tokens,
        **counters,
    )


KV_HANDOFF_TRAILER = "splitserve-kv-handoff"
"""Trailing metadata of a Decode stream that ended UNAVAILABLE because its worker changes role
and keeps the stream's KV for a hand-off (`DecodeWorker.HandOff`): how many leading tokens
(prompt, then generated) that KV covers."""


def kv_kept_from_trailer(metadata: Iterable[tuple[str, Any]] | None) -> int | None:
    """The tokens of KV a moved stream's worker keeps for a hand-off; None if it keeps none."""
    for key, value in metadata or ():
        if key == KV_HANDOFF_TRAILER:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) if text.isdigit() else None
    return None
