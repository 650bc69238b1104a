"""A request's checks before any work is done: each failure is an InvalidRequest that says why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.grammar import Grammars
from splitserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def prompt_token_ids(tokenizer: Any, prompt: Prompt) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids): a text prompt is tokenized, a token-id one
    checked to be ints."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt is empty")
        # NOTE: the special tokens the tokenizer's config adds (BOS for Llama and Mistral),
        # as HF's `tokenizer(prompt)` and vLLM do.
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=True))
    token_ids = list(prompt)
    # NOTE: the set of types first: one C-level pass over a long prompt
    if set(map(type, token_ids)) - {int} and any(
        isinstance(t, bool) or not isinstance(t, int) for t in token_ids
    ):
        raise InvalidRequest("a token-id prompt must be a list of ints")
    return None, token_ids


def check_request(
    token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int,
    block_size: int,
    grammars: Grammars,
) -> None:
    """Raise InvalidRequest unless `token_ids` with `params` can run on this engine."""
    if not token_ids:
        raise InvalidRequest("prompt is empty (no tokens)")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        raise InvalidRequest(
            f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    params.check_token_ids(vocab_size)
    if params.structured is not None:
        grammars.compile(params.structured)  # a bad spec fails here, not mid-batch
    if params.n > max_num_seqs:
        # NOTE: the n samples are scheduled together; more than max_num_seqs never would be.
        raise InvalidRequest(
            f"n is {params.n} but this worker runs at most {max_num_seqs} "
            "sequences at once (max_num_seqs)"
        )
    if len(token_ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt has {len(token_ids)} tokens but the model's context is "
            f"{max_model_len}, which leaves no room to generate"
        )
    # NOTE: a lone sequence must always fit in the pool, or preemption could loop forever.
    need = -(-min(len(token_ids) + params.max_tokens, max_model_len) // block_size)
    if need > num_kv_blocks:
        raise InvalidRequest(f"request needs {need} KV blocks but the pool holds {num_kv_blocks}")
