"""Tool-call parsers on fixed model outputs: Hermes tags and bare JSON (Llama 3) become
`tool_calls` (parallel ones too) with arguments exactly as written; text that is no call stays
content; fed in any pieces (every chunk boundary, one character at a time), a stream gives the
same calls and content as the whole text, and never sends text that turns out to begin a call."""

from __future__ import annotations

import json

import pytest

from splitserve.gateway.tool_call_scanner import ArgsDelta, CallScanner, CallStart, Content
from splitserve.gateway.tool_parsers import (
    ForcedCallsParser,
    HermesParser,
    JsonParser,
    NamedCallParser,
    make_parser,
    parse,
    parser_for_template,
    resolve_parser,
)
from splitserve.testing.tiny_tokenizer import CHATML_TEMPLATE, HERMES_TOOLS_TEMPLATE

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
HERMES_ONE = f"<tool_call>\n{WEATHER}\n</tool_call>"
HERMES_TWO = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
HERMES_ARRAY = (
    '<tool_call>[{"name": "a", "arguments": {"s": "}]\\"<tool_call>"}}, '
    '{"arguments": {"n": [1, {"m": null}]}, "name": "b"}]</tool_call>'
)
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TWO = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'


def _calls(message):
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def _streamed(parser, pieces):
    """Content and calls as a client assembles them from the stream's events."""
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in calls and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ArgsDelta):
            calls[e.index][1] += e.text
    assert sorted(calls) == list(range(len(calls)))  # indices are dense, in order
    return content, [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def _splits(text):
    yield [text]
    yield list(text)
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]


def test_hermes_single_call_has_no_content_and_the_arguments_as_written():
    message = parse(HermesParser(), HERMES_ONE)
    assert message.content is None
    assert _calls(message) == [("get_weather", {"city": "Paris", "days": 3})]
    assert message.tool_calls[0].arguments == '{"city": "Paris", "days": 3}'


def test_hermes_parallel_calls_keep_the_text_before_them_as_content():
    message = parse(HermesParser(), HERMES_TWO)
    assert message.content == "Let me check."
    assert _calls(message) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in message.tool_calls}) == 2


def test_hermes_array_in_one_tag_with_tricky_strings_and_arguments_before_the_name():
    message = parse(HermesParser(), HERMES_ARRAY)
    assert _calls(message) == [("a", {"s": '}]"<tool_call>'}), ("b", {"n": [1, {"m": None}]})]


def test_hermes_plain_text_and_a_broken_call_stay_content():
    plain = parse(HermesParser(), "The answer is 4 < 5. <tool")
    assert plain.content == "The answer is 4 < 5. <tool" and plain.tool_calls == ()
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": 1</tool_call>'
    assert parse(HermesParser(), broken).content == broken
    assert parse(HermesParser(), broken).tool_calls == ()


def test_json_parser_reads_llama3_calls_and_leaves_other_json_and_text_alone():
    assert _calls(parse(JsonParser(), LLAMA_ONE)) == [("get_weather", {"city": "Paris"})]
    assert _calls(parse(JsonParser(), LLAMA_TWO)) == [("a", {"x": 1}), ("b", {})]
    listed = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": "z"}}]'
    assert _calls(parse(JsonParser(), listed)) == [("a", {}), ("b", {"y": "z"})]
    for text in ('{"answer": 42}', "Paris is the capital.", "  {not json", "<|python"):
        message = parse(JsonParser(), text)
        assert (message.content, message.tool_calls) == (text, ())


def test_arguments_given_as_a_json_string_are_decoded():
    text = '{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}'
    assert _calls(parse(JsonParser(), text)) == [("f", {"a": [1, 2]})]


@pytest.mark.parametrize(
    "make, text",
    [
        (HermesParser, HERMES_ONE),
        (HermesParser, HERMES_TWO),
        (HermesParser, HERMES_ARRAY),
        (HermesParser, "no calls here, just <b>bold</b> text\n"),
        (JsonParser, LLAMA_ONE),
        (JsonParser, LLAMA_TWO),
        (JsonParser, '{"answer": 42}'),
        (JsonParser, "just words"),
    ],
)
def test_any_chunking_streams_what_the_whole_text_parses_to(make, text):
    whole = parse(make(), text)
    want_calls = [(c.name, c.arguments) for c in whole.tool_calls]
    for pieces in _splits(text):
        content, calls = _streamed(make(), pieces)
        assert calls == want_calls, pieces
        assert content == (whole.content or ""), pieces


def test_a_stream_holds_back_a_possible_tag_and_whitespace_before_a_call():
    parser = HermesParser()
    assert parser.feed("Checking") == [Content("Checking")]
    assert parser.feed(" \n<tool_") == []  # may begin a call: held
    events = parser.feed('call>{"name": "f", "arguments": {"a"')
    assert events == [CallStart(0, events[0].id, "f"), ArgsDelta(0, '{"a"')]
    assert parser.feed(": 1}}</tool_call>") == [ArgsDelta(0, ": 1}")]
    # a held-back prefix that begins no call is content after all
    other = HermesParser()
    assert other.feed("a <tool") == [Content("a")]
    assert other.finish() == [Content(" <tool")]


def test_arguments_stream_as_fragments_as_they_arrive():
    scanner = CallScanner()
    events, rest = scanner.feed('{"name": "f", "arguments": {"city": "Pa')
    assert events == [CallStart(0, events[0].id, "f"), ArgsDelta(0, '{"city": "Pa')]
    assert rest == "" and not scanner.done
    assert scanner.feed('ris"}} trailing') == ([ArgsDelta(0, 'ris"}')], " trailing")
    assert scanner.done


def test_forced_parsers_read_the_grammar_forms():
    forced = parse(ForcedCallsParser(), '[{"name": "a", "arguments": {"x": 1}}]')
    assert _calls(forced) == [("a", {"x": 1})]
    named = parse(NamedCallParser("get_weather"), '{"city": "Paris"}')
    assert _calls(named) == [("get_weather", {"city": "Paris"})] and named.content is None


def test_auto_picks_the_parser_from_the_chat_template():
    assert parser_for_template(HERMES_TOOLS_TEMPLATE) == "hermes"
    llama = "{%- if tools is not none %}{{- 'Respond in the format {\"name\": ...' }}{%- endif %}"
    assert parser_for_template(llama) == "json"
    assert parser_for_template(CHATML_TEMPLATE) == "hermes"  # renders no tools: our own prompt
    assert resolve_parser("json", HERMES_TOOLS_TEMPLATE) == "json"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        resolve_parser("mistral", None)
    with pytest.raises(ValueError, match="hermes"):
        make_parser("pythonic")
