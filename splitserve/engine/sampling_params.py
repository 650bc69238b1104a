"""Per-request sampling parameters, named and bounded as in vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.engine.errors import InvalidRequest, quoted
from splitserve.engine.structured import StructuredOutput

MAX_LOGPROBS = 20
"""Upper bound on ``SamplingParams.logprobs``; larger requests would make every step pay for a
wide top-k over the vocabulary."""

_MAX_SEED = 2**64 - 1  # the widest value torch.Generator.manual_seed accepts


def _as_int(name: str, value: object) -> int:
    # bool is an Integral, but True as a token count is almost always a caller bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(f"{name} must be an int, got {quoted(value)}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequest(f"{name} must be a number, got {quoted(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise InvalidRequest(f"{name} must be finite, got {result!r}")
    return result


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be in [{low}, {high}], got {value!r}")


def _as_stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        items: tuple[object, ...] = (value,)
    elif isinstance(value, Iterable):
        items = tuple(value)
    else:
        raise InvalidRequest(f"stop must be a str or an iterable of str, got {quoted(value)}")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidRequest(f"stop must contain only str, got {quoted(item)} at index {i}")
        if not item:
            # An empty stop string would match at every position and end generation at once.
            raise InvalidRequest(f"stop must not contain empty strings, got '' at index {i}")
    return items  # type: ignore[return-value]


def _as_token_ids(name: str, value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidRequest(f"{name} must be an iterable of int, got {quoted(value)}")
    ids = tuple(_as_int(name, item) for item in value)
    for i, token_id in enumerate(ids):
        if token_id < 0:
            raise InvalidRequest(f"{name} must be >= 0, got {token_id} at index {i}")
    return ids


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Construction normalises the loose forms an API accepts (a single stop string, lists instead of
    tuples, ``top_k=-1``) and raises ``ValueError`` naming the field, the bad value and the allowed
    range for anything out of bounds, so a bad request fails at admission rather than mid-batch.

    Attributes:
        n: number of completions to generate for the prompt, >= 1.
        temperature: softmax temperature, >= 0; 0 selects greedy decoding.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 (or -1, normalised to 0) disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top one, in [0, 1].
        seed: makes this request's random draws reproducible; None uses the shared RNG.
        repetition_penalty: > 0; values above 1 discourage tokens already in prompt or output.
        presence_penalty: in [-2, 2]; subtracted once from every token already generated.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the generated tokens.
        stop: strings that end generation when they appear in the output.
        stop_token_ids: token ids that end generation when sampled.
        ignore_eos: keep generating past the model's end-of-sequence token.
        max_tokens: upper bound on generated tokens, >= 1.
        min_tokens: EOS and stop ids are suppressed until this many tokens exist (not in a
            structured output, whose grammar alone decides where it ends).
        logprobs: None, or how many top logprobs (0 to 20) to return with each token.
        structured: None, or the grammar the output must follow (a JSON schema, a JSON object,
            a regex or a choice); the sample ends when the grammar is complete.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # the dataclass is frozen; normalising must bypass that

        n = _as_int("n", self.n)
        if n < 1:
            raise InvalidRequest(f"n must be >= 1, got {n}")
        set_field(self, "n", n)

        temperature = _as_float("temperature", self.temperature)
        if temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {temperature!r}")
        set_field(self, "temperature", temperature)

        top_p = _as_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {top_p!r}")
        set_field(self, "top_p", top_p)

        top_k = _as_int("top_k", self.top_k)
        if top_k < -1:
            raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or >= 1, got {top_k}")
        set_field(self, "top_k", max(top_k, 0))

        min_p = _as_float("min_p", self.min_p)
        _check_range("min_p", min_p, 0.0, 1.0)
        set_field(self, "min_p", min_p)

        if self.seed is not None:
            seed = _as_int("seed", self.seed)
            if not 0 <= seed <= _MAX_SEED:
                raise InvalidRequest(f"seed must be None or in [0, 2**64 - 1], got {seed}")
            set_field(self, "seed", seed)

        repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
        set_field(self, "repetition_penalty", repetition_penalty)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            _check_range(name, value, -2.0, 2.0)
            set_field(self, name, value)

        set_field(self, "stop", _as_stop_strings(self.stop))
        set_field(self, "stop_token_ids", _as_token_ids("stop_token_ids", self.stop_token_ids))

        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        max_tokens = _as_int("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
        set_field(self, "max_tokens", max_tokens)

        min_tokens = _as_int("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}"
            )
        set_field(self, "min_tokens", min_tokens)

        if self.logprobs is not None:
            logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise InvalidRequest(
                    f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {logprobs}"
                )
            set_field(self, "logprobs", logprobs)

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequest(
                f"structured must be a StructuredOutput, got {type(self.structured).__name__}"
            )

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax: zero temperature, or only one candidate kept."""
        return self.temperature == 0 or self.top_k == 1

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if a stop token id does not exist in a vocabulary of this size.

        Kept apart from construction because the vocabulary is known only once a model is chosen.
        """
        vocab_size = _as_int("vocab_size", vocab_size)
        if vocab_size < 1:
            raise InvalidRequest(f"vocab_size must be >= 1, got {vocab_size}")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidRequest(
                    f"stop_token_ids must be < vocab_size={vocab_size}, got {token_id}"
                )
