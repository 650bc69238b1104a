"""Tool-call parsers: a model's text, as it streams, into `content` and OpenAI `tool_calls`.

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen, and the
             gateway's own tool prompt for templates that don't render tools); a tag may hold an
             array of calls, and several tags make parallel calls
    json     a reply that is only {"name": ..., "arguments" | "parameters": ...}, or a list of
             them (also split by ";"), optionally after <|python_tag|> (Llama 3's templates)

A parser is made per sample (`make_parser`) and fed the sample's text in pieces (`feed`), then
`finish`ed; each returns `Event`s. Text before the first call is content; once a call has begun,
text outside calls is dropped (as vLLM does). Text that might still turn out to begin a call is
held back until it can't. `parse` runs the same parser over a whole text, so streamed and
gathered answers agree; a whole text whose calls don't all hold a JSON object of arguments is
given back as plain content.

`required` and named `tool_choice` don't parse the model's own format: a grammar makes the model
write the call as JSON (`tool_choice.py`), read by `ForcedCallsParser` / `NamedCallParser`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from splitserve.gateway.tool_call_scanner import (
    ArgsDelta,
    CallScanner,
    CallStart,
    Content,
    Event,
    new_call_id,
)

PARSER_NAMES = ("auto", "hermes", "json")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class ToolCallParser(ABC):
    """Turns one sample's text into content and tool-call events, piece by piece."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events that the text so far completes."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The events left at the end of the sample (text held back that began no call)."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    tool_calls: tuple[ToolCall, ...]


def parse(parser: ToolCallParser, text: str) -> ParsedMessage:
    """A whole sample's text, through `parser`."""
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStart):
            calls[event.index] = [event.id, event.name, ""]
        elif isinstance(event, ArgsDelta):
            calls[event.index][2] += event.text
    tool_calls = tuple(ToolCall(*calls[i]) for i in sorted(calls))
    if not tool_calls or not all(_is_object(call.arguments) for call in tool_calls):
        return ParsedMessage(text, ())
    return ParsedMessage(content or None, tool_calls)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _held_back(text: str, tag: str) -> int:
    """Where the part of `text` that may still begin `tag` starts: whitespace, then a proper
    prefix of the tag, at its end (whitespace just before a call is not content)."""
    at = len(text)
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            at = len(text) - size
            break
    while at > 0 and text[at - 1].isspace():
        at -= 1
    return at


@dataclass
class HermesParser(ToolCallParser):
    """`<tool_call>` tags around a call object or an array of them."""

    _buffer: str = ""
    _state: str = "text"  # text, call (a scanner reads JSON) or after (until </tool_call>)
    _scanner: CallScanner | None = None
    _calls: int = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while self._buffer:
            if self._state == "text":
                at = self._buffer.find(_HERMES_OPEN)
                if at < 0:
                    keep = _held_back(self._buffer, _HERMES_OPEN)
                    if not self._calls and keep:
                        out.append(Content(self._buffer[:keep]))
                    self._buffer = self._buffer[keep:]
                    break
                if not self._calls and self._buffer[:at].rstrip():
                    out.append(Content(self._buffer[:at].rstrip()))
                self._buffer = self._buffer[at + len(_HERMES_OPEN) :]
                self._state = "call"
            elif self._state == "call":
                if self._scanner is None:
                    self._buffer = self._buffer.lstrip()
                    if not self._buffer:
                        break
                    self._scanner = CallScanner(first_index=self._calls)
                events, rest = self._scanner.feed(self._buffer)
                out.extend(events)
                self._calls += sum(isinstance(e, CallStart) for e in events)
                self._buffer = rest
                if not (self._scanner.done or self._scanner.failed):
                    break
                self._scanner, self._state = None, "after"
            else:  # after a call's JSON: another one, or the closing tag
                self._buffer = self._buffer.lstrip()
                if self._buffer[:1] in ("{", "["):
                    self._state = "call"
                    continue
                end = self._buffer.find(_HERMES_CLOSE)
                start = self._buffer.find(_HERMES_OPEN)
                if end >= 0 and (start < 0 or end < start):
                    self._buffer = self._buffer[end + len(_HERMES_CLOSE) :]
                    self._state = "text"
                elif start >= 0:  # an unclosed tag, then the next call
                    self._buffer = self._buffer[start:]
                    self._state = "text"
                else:
                    break
        return out

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        return [Content(text)] if self._state == "text" and text and not self._calls else []


@dataclass
class JsonParser(ToolCallParser):
    """A reply that is only a call object (or a list of them, or several split by `;`)."""

    _state: str = "start"  # start, json (a scanner reads), between (calls), text, or drop
    _raw: str = ""  # all the text, until a call begins (given back as content if none does)
    _pending: str = ""  # text not yet read (start, between)
    _scanner: CallScanner | None = None
    _calls: int = 0

    def feed(self, text: str) -> list[Event]:
        if self._state == "text":
            return [Content(text)] if text else []
        if self._state == "drop":
            return []
        if not self._calls:
            self._raw += text
        out: list[Event] = []
        pending, self._pending = self._pending + text, ""
        while True:
            if self._state in ("start", "between"):
                body = pending.lstrip()
                if self._state == "between":
                    body = body.lstrip(";,").lstrip()
                elif body.startswith(_PYTHON_TAG):
                    body = body[len(_PYTHON_TAG) :].lstrip()
                elif body and _PYTHON_TAG.startswith(body):
                    body = ""  # perhaps the tag: wait for more
                if not body:
                    self._pending = pending
                    return out
                if body[0] not in "{[":
                    if not self._calls:
                        out.append(Content(self._raw))
                    self._state, self._raw = ("drop" if self._calls else "text"), ""
                    return out
                self._state, self._scanner = "json", CallScanner(first_index=self._calls)
                pending = body
            assert self._scanner is not None
            events, rest = self._scanner.feed(pending)
            self._calls += sum(isinstance(e, CallStart) for e in events)
            out.extend(events)
            if not (self._scanner.done or self._scanner.failed):
                return out
            if not self._calls:  # JSON, but no call: it was the answer
                out.append(Content(self._raw))
                self._state, self._raw = "text", ""
                return out
            self._state, self._raw, pending = "between", "", rest

    def finish(self) -> list[Event]:
        if not self._calls and self._state in ("start", "json") and self._raw:
            raw, self._raw = self._raw, ""
            return [Content(raw)]
        return []


@dataclass
class ForcedCallsParser(ToolCallParser):
    """`tool_choice: required`: the grammar made the model write `[{"name", "arguments"}, …]`."""

    _scanner: CallScanner = field(default_factory=CallScanner)

    def feed(self, text: str) -> list[Event]:
        return self._scanner.feed(text)[0]

    def finish(self) -> list[Event]:
        return []


@dataclass
class NamedCallParser(ToolCallParser):
    """A named `tool_choice`: the grammar made the model write that function's arguments."""

    name: str
    _started: bool = False

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        out: list[Event] = []
        if not self._started:
            self._started = True
            out.append(CallStart(0, new_call_id(), self.name))
        out.append(ArgsDelta(0, text))
        return out

    def finish(self) -> list[Event]:
        return []


_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "json": JsonParser}


def make_parser(name: str) -> ToolCallParser:
    """A fresh parser of kind `name` (`hermes` or `json`); ValueError for another."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"tool call parser {name!r}: use one of {', '.join(PARSER_NAMES)}"
        ) from None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template shows the model its `tools` (else the gateway writes them into
    the system message itself)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def parser_for_template(template: str | None) -> str:
    """The parser `auto` picks: hermes where the template writes `<tool_call>` or renders no
    tools at all (the gateway's own tool prompt asks for that form), json where it renders
    tools another way (Llama 3's `{"name": …, "parameters": …}`)."""
    if not renders_tools(template) or _HERMES_OPEN in (template or ""):
        return "hermes"
    return "json"


def resolve_parser(setting: str, template: str | None) -> str:
    """`--tool-call-parser` as the parser it names (`auto`: picked from the template)."""
    if setting not in PARSER_NAMES:
        raise ValueError(
            f"--tool-call-parser must be one of {', '.join(PARSER_NAMES)}, got {setting!r}"
        )
    return parser_for_template(template) if setting == "auto" else setting
