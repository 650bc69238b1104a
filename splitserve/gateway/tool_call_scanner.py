"""An incremental scanner for tool calls written as JSON: a call object, or an array of them.

    {"name": "get_weather", "arguments": {"city": "Paris"}}
    [{"name": "a", "arguments": {...}}, {"name": "b", "parameters": {...}}]

Text comes in pieces (a stream's chunks, cut anywhere, even inside a string or an escape); the
scanner turns it into events as soon as they are known: `CallStart` once a call's name is
complete, then `ArgsDelta` fragments of its arguments' JSON text as they arrive (the raw text
the model wrote, so the fragments join into exactly that text). Arguments may come under
`arguments` or `parameters` (Llama 3's templates), before or after the name (held until the
name is known), or as a JSON string holding the object (sent once it is complete, decoded).
An object without a string `name` is not a call and yields nothing.

The scanner reads one JSON value and stops: `done` (the rest of the text is handed back by
`feed`) or `failed` (the text is not a call object or an array of objects).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class Content:
    """Text for the message's `content`."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its index in the message, its id, the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    """More of tool call `index`'s arguments (JSON text)."""

    index: int
    text: str


Event = Content | CallStart | ArgsDelta


def new_call_id() -> str:
    """An id in OpenAI's form (`call_` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Value:
    """A value being read at a call object's own level."""

    key: str
    kind: str  # "string", "container" or "primitive"
    raw: str = ""
    depth: int = 0  # open brackets (a container)
    in_string: bool = False
    escaped: bool = False


@dataclass
class _Call:
    """The call object being read."""

    name: str | None = None
    index: int = -1
    has_args: bool = False
    held: str = ""  # arguments text that came before the name


@dataclass
class CallScanner:
    """Reads one JSON value of tool calls, fed in pieces; see the module docstring.

    `first_index` is the index its first call gets (calls of earlier values come before)."""

    first_index: int = 0
    calls: int = 0  # calls started so far
    done: bool = False
    failed: bool = False
    _stack: list[str] = field(default_factory=list)
    _call_depth: int = 0  # nesting of a call object's own level (1: a bare object, 2: in [...])
    _expect: str = "key"  # in a call object: key, colon, value or after
    _key: str | None = None  # a key being read (raw, escapes and all)
    _key_escaped: bool = False
    _last_key: str = ""
    _value: _Value | None = None
    _call: _Call | None = None
    _out: list[Event] = field(default_factory=list)

    def feed(self, text: str) -> tuple[list[Event], str]:
        """The events `text` completes, and what follows the value once it is `done` ("" before
        that, and after a failure)."""
        rest = ""
        for i, ch in enumerate(text):
            if self.done or self.failed:
                rest = text[i:] if self.done else ""
                break
            self._step(ch)
        out, self._out = _coalesce(self._out), []
        return out, rest

    # -- one character ---------------------------------------------------------------------

    def _step(self, ch: str) -> None:
        if self._value is not None and self._value_char(ch):
            return
        if self._key is not None:
            self._key_char(ch)
            return
        if ch.isspace():
            return
        depth = len(self._stack)
        if depth == 0:
            if ch == "{":
                self._call_depth = 1
                self._open_call()
            elif ch == "[":
                self._call_depth = 2
                self._stack.append("[")
            else:
                self.failed = True
        elif depth == 1 and self._call_depth == 2:  # in the array, between calls
            if ch == "{":
                self._open_call()
            elif ch == "]":
                self._stack.pop()
                self.done = True
            elif ch != ",":
                self.failed = True
        elif self._expect == "key":
            if ch == '"':
                self._key = ""
            elif ch == "}":
                self._close_call()
            else:
                self.failed = True
        elif self._expect == "colon":
            if ch == ":":
                self._expect = "value"
            else:
                self.failed = True
        elif self._expect == "value":
            kind = "string" if ch == '"' else "container" if ch in "{[" else "primitive"
            self._value = _Value(self._last_key, kind)
            self._value_char(ch, first=True)
        elif ch == ",":  # after a value
            self._expect = "key"
        elif ch == "}":
            self._close_call()
        else:
            self.failed = True

    def _key_char(self, ch: str) -> None:
        assert self._key is not None
        if self._key_escaped:
            self._key_escaped = False
        elif ch == "\\":
            self._key_escaped = True
        elif ch == '"':
            self._last_key, self._key = _decoded(self._key) or "", None
            self._expect = "colon"
            return
        self._key += ch

    def _value_char(self, ch: str, first: bool = False) -> bool:
        """Record `ch` in the value being read; False if the value ended before it (a number,
        true, false or null ends at the next delimiter, which is then read structurally)."""
        value = self._value
        assert value is not None
        if value.kind == "primitive":
            if not first and (ch in ",}]" or ch.isspace()):
                self._end_value()
                return False
            value.raw += ch
            return True
        value.raw += ch
        ended = False
        if value.in_string:
            if value.escaped:
                value.escaped = False
            elif ch == "\\":
                value.escaped = True
            elif ch == '"':
                value.in_string = False
                ended = value.kind == "string"
        elif ch == '"':
            value.in_string = True
        elif ch in "{[":
            value.depth += 1
        elif ch in "}]":
            value.depth -= 1
            ended = value.depth == 0
        if value.kind == "container" and value.key in ARGUMENT_KEYS:
            self._arguments(ch)
        if ended:
            self._end_value()
        return True

    # -- calls -----------------------------------------------------------------------------

    def _open_call(self) -> None:
        self._stack.append("{")
        self._call, self._expect = _Call(), "key"

    def _close_call(self) -> None:
        self._stack.pop()
        call, self._call = self._call, None
        if call is not None and call.name is not None and not call.has_args:
            self._arguments("{}")  # a call that names no arguments takes none
        self._expect = "after"
        if self._call_depth == 1:
            self.done = True

    def _end_value(self) -> None:
        value, self._value = self._value, None
        self._expect = "after"
        call = self._call
        if value is None or call is None:
            return
        if value.key == "name" and value.kind == "string" and call.name is None:
            name = _decoded(value.raw[1:-1])
            if name is not None:
                call.name, call.index = name, self.first_index + self.calls
                self.calls += 1
                self._out.append(CallStart(call.index, new_call_id(), name))
                if call.held:
                    self._out.append(ArgsDelta(call.index, call.held))
                    call.held = ""
        elif value.key in ARGUMENT_KEYS and not call.has_args:
            if value.kind == "string":  # the arguments' JSON text, as a JSON string
                self._arguments(_decoded(value.raw[1:-1]) or "")
            elif value.kind == "primitive":
                self._arguments("{}" if value.raw == "null" else value.raw)
            call.has_args = True

    def _arguments(self, text: str) -> None:
        call = self._call
        if call is None:
            return
        if call.name is None:
            call.held += text
        else:
            self._out.append(ArgsDelta(call.index, text))


def _decoded(raw: str) -> str | None:
    """The text of a JSON string's body (escapes and all); None if it is not one."""
    try:
        text = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return None
    return text if isinstance(text, str) else None


def _coalesce(events: list[Event]) -> list[Event]:
    """Adjacent fragments of one call's arguments (or adjacent content) as one event."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        same_call = isinstance(last, ArgsDelta) and last.index == getattr(event, "index", -1)
        if isinstance(event, ArgsDelta) and isinstance(last, ArgsDelta) and same_call:
            out[-1] = ArgsDelta(event.index, last.text + event.text)
            continue
        if isinstance(event, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + event.text)
            continue
        out.append(event)
    return out
