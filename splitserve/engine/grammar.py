"""Grammars for structured outputs, compiled by xgrammar from the model's own tokenizer.

    StructuredOutput ──Grammars.compile (LRU)──▶ xgrammar CompiledGrammar
                     ──Grammars.attach──▶ one GrammarState (matcher) per sequence
    each step:  TokenBitmask.apply: fill [rows, ceil(vocab/32)] for the constrained rows,
                -inf on the logits of the tokens they may not produce (free rows untouched)
    each token: GrammarState.advance; a grammar that is complete ends the sample

NOTE: the mask goes on the logits after the model (and after a replayed CUDA graph), never
inside a captured graph: which tokens are allowed changes with every token.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

from splitserve.engine.errors import InvalidRequest, clip
from splitserve.engine.structured import StructuredOutput

if TYPE_CHECKING:
    from splitserve.engine.sequence import Sequence as EngineSequence

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept per engine, least recently used dropped first."""

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "


# NOTE: xgrammar (0.2.x, mlc-ai/xgrammar#800) writes a string with `minLength`/`maxLength` as a
# repetition of this bare class, which admits raw control characters (not JSON); the class every
# other JSON string uses excludes them. (Its regex path, the other way to bound a length, lets
# malformed UTF-8 through, so the grammar is patched instead.)
_BOUNDED_STRING_CLASS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CLASS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def json_schema_ebnf(schema: str, strict: bool) -> str:
    """The grammar of compact JSON valid under `schema`, as xgrammar EBNF."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return str(grammar).replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS)


def _compile_error(spec: StructuredOutput, error: Exception) -> InvalidRequest:
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(error).splitlines()]
    detail = " ".join(line for line in lines if line)
    return InvalidRequest(clip(f"structured output {spec.kind} does not compile: {detail}", 400))


class GrammarState:
    """One sequence's position in its grammar (an xgrammar matcher)."""

    __slots__ = ("_matcher", "rejected")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self.rejected = False

    def advance(self, token_id: int) -> bool:
        """Take the sampled token; True when the sample must end here: the grammar accepted its
        stop token, or (never with the mask applied) refused the token."""
        if not self._matcher.accept_token(token_id):
            self.rejected = True
            return True
        return self._matcher.is_terminated()

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        return self._matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles specs for one tokenizer (built on first use) and caches the results."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids) or None
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0
        self.num_cache_hits = 0

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            # NOTE: xgrammar's own cache is off; ours is bounded in entries and keyed by spec.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The grammar for `spec`; raise InvalidRequest if xgrammar can't compile it."""
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            self.num_cache_hits += 1
            return compiled
        compiler = self._get_compiler()
        try:
            if spec.json_schema is not None or spec.json_object:
                # Compact JSON: free whitespace would let a sample wander without ending.
                # strict: an object holds only the properties its schema names (OpenAI's
                # `strict`); a bare JSON object may hold any.
                schema = spec.json_schema or _JSON_OBJECT_SCHEMA
                compiled = compiler.compile_grammar(
                    json_schema_ebnf(schema, strict=not spec.json_object)
                )
            elif spec.regex is not None:
                compiled = compiler.compile_regex(spec.regex)
            else:
                assert spec.choice is not None
                # JSON string literals are valid EBNF literals, escapes included.
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
                compiled = compiler.compile_grammar(f"root ::= {alternatives}")
        except RuntimeError as e:
            raise _compile_error(spec, e) from None
        self.num_compiled += 1
        self._cache[spec] = compiled
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def attach(self, seqs: Iterable[EngineSequence], spec: StructuredOutput | None) -> None:
        """Give each sequence a fresh matcher for `spec` (or none when unconstrained), moved
        past the tokens it already generated (a stream resumed on another worker)."""
        if spec is None:
            for seq in seqs:
                seq.grammar = None
            return
        compiled = self.compile(spec)
        for seq in seqs:
            state = seq.grammar = GrammarState(compiled)
            for token_id in seq.output_token_ids:
                if state.advance(token_id) and state.rejected:
                    raise InvalidRequest(
                        f"the generated token {token_id} does not follow the {spec.kind} grammar"
                    )


class TokenBitmask:
    """Masks the logits of a batch's constrained rows; one host buffer reused across steps.

    The rows' masks are filled in parallel, in xgrammar's own threads (half the host's cores by
    default): a matcher inside a JSON string or a long regex class checks tens of thousands of
    tokens, about half a millisecond each on one core for a 128k vocabulary, so filling 32 rows
    one after another cost more than a whole decode step (bench/structured.py)."""

    def __init__(self, max_threads: int | None = None) -> None:
        self._host: torch.Tensor | None = None
        self._batch = xgr.BatchGrammarMatcher(max_threads or "auto")

    def _buffer(self, num_rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
        host = self._host
        width = xgr.get_bitmask_shape(1, vocab_size)[1]
        if host is None or host.shape[0] < num_rows or host.shape[1] != width:
            host = torch.empty(max(num_rows, 8), width, dtype=xgr.bitmask_dtype, pin_memory=pin)
            self._host = host
        return host[:num_rows]

    def apply(self, logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
        """Set to -inf, in place, each constrained row's logits of tokens its grammar forbids
        next; rows whose grammar is None are left as they are."""
        rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return
        pin = logits.device.type == "cuda"
        bitmask = self._buffer(len(grammars), logits.shape[1], pin)
        matchers = [grammar.matcher for grammar in grammars if grammar is not None]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        # NOTE: the host buffer is refilled only after this step's tokens were read back, so the
        # asynchronous copy has finished by then.
        device_mask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, device_mask, indices=rows)
