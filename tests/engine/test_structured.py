"""Structured outputs on the offline engine: JSON schemas, regexes and choices on a random model.

The tiny model's weights are random, so whatever it writes is odd; every output must still be
exactly what its grammar allows, and end because the grammar is complete.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.errors import InvalidRequest
from splitserve.engine.grammar import GrammarState, TokenBitmask
from splitserve.engine.outputs import CompletionOutput, Resume
from splitserve.engine.structured import StructuredOutput
from tests.engine.hf_oracle import random_prompts

NUM_SCHEMAS = 200


@pytest.fixture(scope="module")
def llm(tiny_models):
    # Many sequences per step: the 200 schemas run in a handful of batches.
    return LLM(tiny_models["llama"], max_num_seqs=128, max_num_batched_tokens=4096)


def _vocab(llm: LLM) -> int:
    return llm.engine.model_config.vocab_size


def _text_prompts(count: int) -> list[str]:
    # Text, not random ids: a random id prompt can end inside a UTF-8 character, and the
    # output text then starts by completing it.
    words = ["The", "record", "of", "item", "blue", "fox", "says", "answer:", "data", "is"]
    return [" ".join(words[(i + k) % len(words)] for k in range(3 + i % 5)) for i in range(count)]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of bounded size: nested objects, arrays, enums, required fields, strings,
    integers, numbers and booleans, each bounded so that any output of it is short."""
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        low = rng.randint(0, 2)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 3)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number", "minimum": -50, "maximum": 50}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        pool = ["red", "green", "blue", 1, 2.5, True, None, "a b", 'q"uote']
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 1),
        }
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "meta", "x"], rng.randint(1, 3))
    return {
        "type": "object",
        "properties": {name: random_schema(rng, depth + 1) for name in names},
        "required": [name for name in names if rng.random() < 0.6],
    }


def _object_schemas(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    schemas = []
    while len(schemas) < count:
        schema = random_schema(rng)
        if schema.get("type") != "object":  # a top-level object, as response_format asks
            schema = {"type": "object", "properties": {"value": schema}, "required": ["value"]}
        schemas.append(schema)
    return schemas


def test_random_json_schemas_give_valid_json(llm):
    schemas = _object_schemas(NUM_SCHEMAS, seed=2026)
    prompts = _text_prompts(NUM_SCHEMAS)
    params = [
        SamplingParams(
            # Half greedy, half sampled: sampling visits far more of each grammar.
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            max_tokens=400,
            structured=StructuredOutput(json_schema=json.dumps(schema)),
        )
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(schemas, outputs, strict=True):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", (schema, sample.text)
        assert "\ufffd" not in sample.text, "malformed UTF-8"
        value = json.loads(sample.text)  # strict: no raw control characters in strings
        jsonschema.validate(value, schema)


REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
    r"\d{4}-\d{2}-\d{2}",
    r"(yes|no|maybe)!?",
    r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
    r"-?(0|[1-9]\d{0,3})(\.\d{1,2})?",
    r"\(\d{3}\) \d{3}-\d{4}",
]


def test_regex_outputs_match_in_full(llm):
    prompts = _text_prompts(3 * len(REGEXES))
    params = [
        SamplingParams(
            temperature=(i % 3) * 0.7,
            seed=i,
            max_tokens=64,
            structured=StructuredOutput(regex=REGEXES[i % len(REGEXES)]),
        )
        for i in range(len(prompts))
    ]
    for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop"
        assert re.fullmatch(REGEXES[i % len(REGEXES)], sample.text), sample.text


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ("positive", "negative", "neutral", 'a "quoted"\nline', "日本")
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=32, structured=StructuredOutput(choice=choices)
    )
    prompts = _text_prompts(4)
    seen = set()
    for out in llm.generate(prompts, params, use_tqdm=False):
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            assert sample.text in choices
            seen.add(sample.text)
    assert len(seen) > 1, "sampling among the choices always picked the same one"


def test_free_requests_are_unchanged_by_constrained_neighbours(llm):
    prompts = random_prompts([8, 21, 3, 40, 15, 27], _vocab(llm), seed=31)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    schema = json.dumps(_object_schemas(1, seed=7)[0])
    constrained = [
        SamplingParams(
            temperature=0, max_tokens=32, structured=StructuredOutput(json_schema=schema)
        ),
        SamplingParams(temperature=0, max_tokens=32, structured=StructuredOutput(regex=r"\d+x")),
        SamplingParams(
            temperature=0, max_tokens=32, structured=StructuredOutput(choice=("a", "b"))
        ),
    ]
    mixed_params = [p for pair in zip([free] * 3, constrained, strict=True) for p in pair]
    mixed_params += [free] * 3
    mixed_prompts = [p for pair in zip(prompts[:3], prompts[3:], strict=True) for p in pair]
    mixed_prompts += prompts[3:]
    outputs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    free_outputs = [outputs[0], outputs[2], outputs[4], *outputs[6:]]
    expected = [alone[0], alone[1], alone[2], *alone[3:]]
    assert [o.outputs[0].token_ids for o in free_outputs] == expected
    # ...and the constrained ones did differ from what the model writes unconstrained.
    assert outputs[1].outputs[0].token_ids != alone[3]


def test_json_object_is_an_object(llm):
    spec = StructuredOutput(json_object=True)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, structured=spec)
    prompts = _text_prompts(3)
    for out in llm.generate(prompts, params, use_tqdm=False):
        sample = out.outputs[0]
        if sample.finish_reason == "stop":
            assert isinstance(json.loads(sample.text), dict)
        else:  # an open object cut at max_tokens is still a prefix of one
            assert sample.text.startswith("{")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(regex=r"(?=a)b"), "Lookahead is not supported"),
        (StructuredOutput(regex=r"\bword"), "Word boundary"),
    ],
)
def test_specs_the_grammar_engine_refuses_fail_at_admission(llm, spec, message):
    engine = llm.engine
    params = SamplingParams(max_tokens=8, structured=spec)
    with pytest.raises(InvalidRequest, match=message) as info:
        engine.add_request([5, 6, 7], params)
    assert len(str(info.value)) < 500 and "/project/" not in str(info.value)
    assert not engine.has_unfinished_requests()


def test_invalid_json_schema_is_refused_by_the_spec():
    with pytest.raises(InvalidRequest, match="not a valid JSON Schema"):
        StructuredOutput(json_schema='{"type": "object", "minProperties": "x"}')


def test_compiled_grammars_are_cached_by_spec(llm):
    grammars = llm.engine.grammars
    spec = StructuredOutput(regex=r"cache-[0-9]{3}")
    before = grammars.num_compiled
    params = SamplingParams(temperature=0, max_tokens=16, structured=spec)
    llm.generate(random_prompts([5, 6, 7], _vocab(llm), seed=51), params, use_tqdm=False)
    again = SamplingParams(
        temperature=0.5, max_tokens=16, structured=StructuredOutput(regex=spec.regex)
    )
    llm.generate(random_prompts([5], _vocab(llm), seed=52), again, use_tqdm=False)
    assert grammars.num_compiled == before + 1


def test_bitmask_masks_only_constrained_rows(llm):
    grammars = llm.engine.grammars
    vocab = _vocab(llm)
    state = GrammarState(grammars.compile(StructuredOutput(choice=("yes",))))
    logits = torch.randn(3, vocab)
    original = logits.clone()
    TokenBitmask().apply(logits, [None, state, None])
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    tokenizer = llm.engine.tokenizer
    assert allowed and all("yes".startswith(tokenizer.decode([t])) for t in allowed)


def test_length_bounded_strings_are_json_and_utf8(llm):
    """Regression for the grammar engine's bounded strings (see engine/grammar.py): no raw
    control character, no malformed UTF-8, and the bound still holds."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}
    compiled = llm.engine.grammars.compile(StructuredOutput(json_schema=json.dumps(schema)))
    assert xgr.GrammarMatcher(compiled).accept_string('{"a": "\u00e9\u65e5x"}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"a": "abcd')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"a": "a\x11')
    tokenizer = llm.engine.tokenizer
    prefix = tokenizer.encode('{"a": "', add_special_tokens=False)
    overlong = tokenizer.convert_tokens_to_ids(["\u00e0", "\u0127"])  # bytes E0 85 (byte-level)
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in prefix)
    assert matcher.accept_token(overlong[0]) and not matcher.accept_token(overlong[1])


def test_min_tokens_does_not_keep_a_complete_grammar_going(llm):
    spec = StructuredOutput(choice=("yes", "no"))
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=8, structured=spec)
    sample = llm.generate(_text_prompts(1), params, use_tqdm=False)[0].outputs[0]
    assert sample.text in ("yes", "no") and sample.finish_reason == "stop"
    # Ended by the end-of-sequence token the grammar allows, not by a token nothing allowed.
    assert sample.token_ids[-1] in llm.engine.model_config.eos_token_ids


def test_a_resumed_structured_sample_goes_on_in_its_grammar(tiny_models):
    """A stream moved to another decode worker: the new matcher is advanced past the tokens the
    sample already has, so the rest follows the grammar and equals the unbroken run."""
    engine = LLMEngine(tiny_models["llama"], EngineConfig(block_size=16, num_kv_blocks=64))
    schema = _object_schemas(1, seed=11)[0]
    spec = StructuredOutput(json_schema=json.dumps(schema))
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=200, structured=spec)
    prompt = list(engine.tokenizer.encode(_text_prompts(1)[0], add_special_tokens=False))
    engine.add_request(prompt, params, "whole")
    whole = _finish(engine, "whole")
    assert whole.finish_reason == "stop" and len(whole.token_ids) > 4
    for cut in (1, len(whole.token_ids) // 2):
        rid = f"resumed-{cut}"
        engine.reserve(rid, prompt, params, Resume(0, tuple(whole.token_ids[:cut])))
        engine.admit(rid, params, None)
        resumed = _finish(engine, rid)
        assert resumed.token_ids == whole.token_ids and resumed.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.text), schema)
    bad = Resume(0, (engine.model_config.eos_token_ids[0],))  # not how any JSON starts
    engine.reserve("bad", prompt, params, bad)
    with pytest.raises(InvalidRequest, match="does not follow the json_schema grammar"):
        engine.admit("bad", params, None)
    assert engine.abort_request("bad"), "the refused admission lost its reservation"
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def _finish(engine: LLMEngine, request_id: str) -> CompletionOutput:
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0]
