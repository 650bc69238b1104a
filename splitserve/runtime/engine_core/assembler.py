"""Front side of the token path: rebuilds a request's cumulative output from the core's step
entries, detokenizing here so that no text is made in the engine core's interpreter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from splitserve.engine.outputs import CompletionOutput, RequestOutput
from splitserve.engine.tokenizer import IncrementalDetokenizer
from splitserve.runtime.engine_core.protocol import speculation_from_wire


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    detok: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OutputAssembler:
    """One request's outputs as the engine would have built them, from step entries."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.tokenizer = tokenizer
        self._samples: dict[int, _Sample] = {}

    def apply(self, entry: list[Any]) -> RequestOutput:
        _, finished, num_cached, samples, speculation = entry
        for index, new_tokens, new_logprobs, reason, stop, text_len in samples:
            s = self._samples.get(index)
            if s is None:
                s = self._samples[index] = _Sample()
                if self.tokenizer is not None:
                    s.detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
            s.token_ids.extend(new_tokens)
            if new_logprobs is not None:
                s.logprobs = s.logprobs or []
                s.logprobs.extend(dict(map(tuple, d)) for d in new_logprobs)
            s.finish_reason, s.stop_reason = reason, stop
            if s.detok is not None:
                s.detok.add(new_tokens, final=reason is not None)
                if text_len is not None:
                    s.detok.text = s.detok.text[:text_len]
        return RequestOutput(
            request_id=self.request_id,
            prompt=None,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=index,
                    text=s.detok.text if s.detok is not None else "",
                    # NOTE: copies: this thread extends the lists while a stream reads its last
                    # output on another (a shared list loses or repeats tokens in a delta)
                    token_ids=list(s.token_ids),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=None if s.logprobs is None else list(s.logprobs),
                )
                for index, s in sorted(self._samples.items())
            ],
            finished=finished,
            num_cached_tokens=num_cached,
            speculation=speculation_from_wire(speculation),
        )
