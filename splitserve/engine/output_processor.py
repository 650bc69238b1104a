"""Detokenizes new tokens, applies stop strings, and builds `RequestOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from splitserve.engine.outputs import CompletionOutput, RequestOutput, SpeculationUsage
from splitserve.engine.sequence import Sequence
from splitserve.engine.tokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]  # index i holds sample i
    detokenizers: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)


@dataclass(frozen=True)
class StopStringHit:
    seq: Sequence
    stop: str


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stream_text: bool = True) -> None:
        """With `stream_text` off (offline use), text is decoded when a sequence finishes, or
        step by step only for sequences with stop strings: decoding is costly per step."""
        self.tokenizer = tokenizer
        self.stream_text = stream_text
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for seq in state.sequences:
            if seq.output_token_ids and self.tokenizer is not None:
                # NOTE: a resumed sample (`Sequence.resume`): the text of its earlier tokens is
                # known before it goes on, and only later text is searched for stop strings,
                # as on the worker that began it.
                detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
                detok.add(seq.output_token_ids)
                state.detokenizers[seq.seq_id] = detok
                state.texts[seq.seq_id] = detok.text

    def detokenize(self, seqs: list[Sequence]) -> list[StopStringHit]:
        """Extend each sequence's text by its newest token; report stop strings found.

        The text of a sequence that hit a stop string is cut before the stop string.
        """
        hits: list[StopStringHit] = []
        for seq in seqs:
            state = self.requests.get(seq.request_id)
            if state is None or self.tokenizer is None:
                continue
            if not (self.stream_text or seq.params.stop or seq.is_finished):
                continue  # offline: text is made once, at the end
            detok = state.detokenizers.get(seq.seq_id)
            if detok is None:
                detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
                state.detokenizers[seq.seq_id] = detok
            stops = seq.params.stop
            new = seq.output_token_ids[detok.num_fed :]
            # NOTE: several new tokens (an accepted speculative run) are fed one at a time when
            # stop strings are asked for, so that tokens after the one completing a stop string
            # are dropped, as if they had never been generated.
            chunks = [[t] for t in new] if stops and len(new) > 1 else [new]
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                delta = detok.add(chunk, final=seq.is_finished and last)
                text = detok.text
                if delta and stops and detok.num_fed > seq.params.min_tokens:
                    # Only the new text and a stop's length before it can contain a new match.
                    window_start = max(0, len(text) - len(delta) - max(map(len, stops)) + 1)
                    found = [(text.find(s, window_start), s) for s in stops]
                    found = [(pos, s) for pos, s in found if pos >= 0]
                    if found:
                        pos, stop = min(found)
                        text = text[:pos]
                        hits.append(StopStringHit(seq, stop))
                        del seq.output_token_ids[detok.num_fed :]
                        del seq.output_logprobs[detok.num_fed :]
                        break
            state.texts[seq.seq_id] = text
        return hits

    def output(self, request_id: str) -> RequestOutput:
        state = self.requests[request_id]
        outputs = []
        for seq in state.sequences:
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=state.texts.get(seq.seq_id, ""),
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                )
            )
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=state.sequences[0].num_cached_prompt_tokens,
            speculation=_speculation(state.sequences),
        )

    def pop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def _speculation(seqs: list[Sequence]) -> SpeculationUsage | None:
    """The request's speculation: its samples' summed; None if none speculated."""
    usages = [seq.speculation for seq in seqs if seq.speculation is not None]
    if not usages:
        return None
    if len(usages) == 1:
        return usages[0]
    return SpeculationUsage(
        sum(u.num_drafts for u in usages),
        sum(u.num_draft_tokens for u in usages),
        sum(u.num_accepted_tokens for u in usages),
    )
