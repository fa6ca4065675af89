"""Tool calls parsed out of a model's output, whole or as it streams.

A :class:`ToolParser` knows one model family's way of writing a call:

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number
  of them, with text before, between and after (Qwen2.5, Qwen3, Hermes 2/3, as their chat
  templates ask for);
- ``llama3_json``: Llama 3.1's JSON tool call, ``{"name": "f", "parameters": {...}}``, the
  whole reply, optionally after ``<|python_tag|>``; several separated by ``;``.

:meth:`ToolParser.parse` splits a finished text into its content (the text outside the
calls, ``None`` when there is none) and its :class:`ToolCall` s. :meth:`ToolParser.stream`
gives a :class:`ToolStream` that takes the text as it is generated and returns, per piece,
the content that is certain to be content and the calls completed in it: text that may
still turn out to open a call is held back, and a call is handed out once it is closed
and parses, so a malformed one is never half-sent: it is content, whole or streamed. The
calls' ``arguments`` are the model's own JSON text of the arguments object, the same
whole or streamed.

A call cut off by the token limit (``flush(cut_off=True)``) is never content: as OpenAI
and vLLM report one, it is a call with the arguments written so far, once its name is
whole, and nothing before that. Those arguments are always a start of the arguments
object's own JSON text, up to where the object closes: never the text that wraps the call
(the call object's closing brace, a cut end tag, a separator).

Nothing here knows about HTTP, the chat template or the grammar that forces a call
(:mod:`spececd.openai_api.tools`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

from spececd.errors import InputError

__all__ = ["PARSERS", "HermesParser", "Llama3JsonParser", "ToolCall", "ToolParser",
           "ToolStream", "parser"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object, as JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


_DECODER = json.JSONDecoder()


def _call(text: str, arguments_key: str) -> ToolCall | None:
    """The call that ``text`` (one JSON object, surrounding whitespace allowed) spells, or
    None: not JSON, not an object, no string ``name``, arguments not an object."""
    text = text.strip()
    try:
        obj, end = _DECODER.raw_decode(text)
    except (json.JSONDecodeError, RecursionError):  # deeper than Python parses
        return None
    if end != len(text) or not isinstance(obj, dict):
        return None
    return _from_object(obj, text, arguments_key)


def _from_object(obj: dict[str, Any], text: str, arguments_key: str) -> ToolCall | None:
    name, arguments = obj.get("name"), obj.get(arguments_key, {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, _raw_arguments(text, arguments_key) or json.dumps(arguments))


def _partial_call(text: str, keys: tuple[str, ...]) -> ToolCall | None:
    """The call a cut-off ``text`` began: its name once whole, and the arguments text
    written so far (None: it was cut within or before its name): the start of the
    arguments object, up to where it closes (:func:`_object_prefix`), never the text
    that wraps the call (its closing brace, the start of an end tag)."""
    head = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"'
    match = re.match(head + r'\s*(?:,\s*"(?:' + "|".join(keys) + r')"\s*:\s*(.*))?',
                     text, re.DOTALL)
    if match is None:
        return None
    try:
        name = json.loads(f'"{match[1]}"')
    except json.JSONDecodeError:
        return None
    return ToolCall(name, _object_prefix(match[2] or "")) if name else None


# JSON's tokens: whole (a string, number, literal or punctuation), and one cut short by the
# end of the text (a prefix of a string, number or literal).
_CHARS = r'(?:[^"\\]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*'
_INT = r"-?(?:0|[1-9][0-9]*)"
_TOKEN = re.compile(rf'\s*(?:(?P<scalar>"{_CHARS}"|{_INT}(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?'
                    r"|true|false|null)|(?P<mark>[{}\[\],:]))")
_CUT = re.compile(rf'\s*(?:(?P<key>"{_CHARS}(?:\\(?:u[0-9a-fA-F]{{0,3}})?)?)|-|{_INT}\.?[0-9]*'
                  rf"|{_INT}(?:\.[0-9]+)?[eE][+-]?[0-9]*"
                  r"|t(?:r(?:ue?)?)?|f(?:a(?:l(?:se?)?)?)?|n(?:u(?:ll?)?)?)?\Z")
# What may come next: a value, an object's key, the colon after it, a comma or a close.
_VALUE, _KEY, _COLON, _NEXT = "value", "key", "colon", "next"


def _object_prefix(text: str) -> str:
    """The longest start of ``text`` that is the start of a JSON object, ending where the
    object closes: a cut-off call's arguments as the model wrote them, without what
    follows the object (the wrapper's brace, an end tag) or anything from where the text
    stops being JSON. Strings may hold raw control characters, as xgrammar lets them."""
    closers: list[str] = []  # the open containers' closing marks, innermost last
    expect, may_close, pos = _VALUE, False, 0
    number_at = -1  # where the last token began, when it is a number (it may go on)
    while (token := _TOKEN.match(text, pos)) is not None:
        mark = token["mark"]
        if not closers and mark != "{":  # the arguments are an object
            break
        if mark is None:  # a string, number or literal
            if expect == _KEY and token["scalar"].startswith('"'):
                expect, may_close = _COLON, False
            elif expect == _VALUE:
                expect, may_close = _NEXT, True
            else:
                break
        elif mark in "{[" and expect == _VALUE:
            closers.append("}" if mark == "{" else "]")
            expect, may_close = (_KEY if mark == "{" else _VALUE), True
        elif mark == closers[-1] and may_close:
            closers.pop()
            if not closers:
                return text[:token.end()]  # whole: what follows wraps the call
            expect, may_close = _NEXT, True
        elif mark == "," and expect == _NEXT:
            expect, may_close = (_KEY if closers[-1] == "}" else _VALUE), False
        elif mark == ":" and expect == _COLON:
            expect, may_close = _VALUE, False
        else:
            break
        pos = token.end()
        number = mark is None and token["scalar"][0] in "-0123456789"
        number_at = token.start("scalar") if number else -1
    if closers and (_cut_at(text, pos, expect)
                    or (number_at >= 0 and _CUT.match(text, number_at) is not None)):
        return text  # cut within a token (a number cut short may look whole)
    return text[:pos]


def _cut_at(text: str, pos: int, expect: str) -> bool:
    """Whether ``text`` from ``pos`` is space, then a token cut short that may come where
    ``expect`` says."""
    cut = _CUT.match(text, pos)
    return cut is not None and (not cut[0].strip() or expect == _VALUE
                                or (expect == _KEY and cut["key"] is not None))


def _raw_arguments(text: str, key: str) -> str | None:
    """The arguments object's own text within ``text``, where the model wrote it right
    after the name (as templates show it), so the streamed and whole forms agree."""
    match = re.match(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"' + key + r'"\s*:\s*',
                     text)
    if match is None:
        return None
    try:
        _, end = _DECODER.raw_decode(text, match.end())
    except (json.JSONDecodeError, RecursionError):  # deeper than Python parses
        return None
    return text[match.end():end]


class ToolStream:
    """One generation's text, fed piece by piece (:meth:`push`, then :meth:`flush` at the
    end); each returns ``(content, calls)``: text certain to be content, and the calls
    completed so far."""

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def flush(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        """The rest; ``cut_off``: the output ended at the token limit, so an unfinished
        call is a call cut short (see the module docstring), not content."""
        raise NotImplementedError


class ToolParser:
    name: ClassVar[str]

    def stream(self) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``text`` split into its content (None if empty) and its calls."""
        stream = self.stream()
        content, calls = stream.push(text)
        rest, more = stream.flush()
        content += rest
        return content or None, calls + more


class HermesParser(ToolParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks anywhere in the text."""

    name = "hermes"
    begin, end = "<tool_call>", "</tool_call>"

    def stream(self) -> ToolStream:
        return _TaggedStream(self.begin, self.end, "arguments")


class _TaggedStream(ToolStream):
    def __init__(self, begin: str, end: str, arguments_key: str) -> None:
        self.begin, self.end, self.key = begin, end, arguments_key
        self.buffer = ""
        self.inside = False  # within a call: the buffer is the call's text after ``begin``
        self.after_call = False  # whitespace right after a call is no content

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self.after_call:
                self.buffer = self.buffer.lstrip()
                self.after_call = not self.buffer
            if self.inside:
                at = _find_outside_strings(self.buffer, self.end)
                if at < 0:
                    return "".join(content), calls
                body, self.buffer = self.buffer[:at], self.buffer[at + len(self.end):]
                self.inside = False
                call = _call(body, self.key)
                if call is None:  # malformed: the block stays text
                    content.append(self.begin + body + self.end)
                else:
                    calls.append(call)
                    self.after_call = True
                continue
            at = self.buffer.find(self.begin)
            if at >= 0:
                content.append(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at + len(self.begin):], True
                continue
            keep = _partial_suffix(self.buffer, self.begin)
            content.append(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return "".join(content), calls

    def flush(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        if self.inside and cut_off:
            call = _partial_call(self.buffer, (self.key,))
            self.buffer, self.inside = "", False
            return "", [call] if call else []
        # An unclosed call at a stop: its text is content (not a call).
        rest = (self.begin + self.buffer) if self.inside else self.buffer
        self.buffer, self.inside = "", False
        return rest, []


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON calls: the reply is one or more ``{"name": ..., "parameters":
    ...}`` objects (``arguments`` is taken too), separated by ``;``, optionally after
    ``<|python_tag|>``; a reply that starts otherwise is content."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def stream(self) -> ToolStream:
        return _Llama3Stream(self.python_tag)


class _Llama3Stream(ToolStream):
    def __init__(self, python_tag: str) -> None:
        self.tag = python_tag
        self.buffer = ""  # in "calls" mode: the text after the tag, from the first object
        self.mode = "undecided"  # then "content" or "calls"
        self.done = 0  # how much of the buffer the calls handed out so far span
        self.prefix = ""  # what came before the buffer: the tag, and spaces before it

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if not head or (self.tag.startswith(head) and head != self.tag):
                return "", []  # nothing telling yet
            if head.startswith(self.tag):
                at = self.buffer.index(self.tag) + len(self.tag)
                self.mode, self.prefix, self.buffer = "calls", self.buffer[:at], \
                    self.buffer[at:]
            else:
                self.mode = "calls" if head.startswith("{") else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", self._complete()

    def _complete(self) -> list[ToolCall]:
        """The calls whose objects have closed since last asked."""
        calls: list[ToolCall] = []
        while True:
            pos = self.done
            while pos < len(self.buffer) and (self.buffer[pos].isspace() or (
                    self.done and self.buffer[pos] == ";")):
                pos += 1
            try:
                obj, end = _DECODER.raw_decode(self.buffer, pos)
            except (json.JSONDecodeError, RecursionError):  # deeper than Python parses
                return calls
            call = None
            if isinstance(obj, dict):
                key = "parameters" if "parameters" in obj else "arguments"
                call = _from_object(obj, self.buffer[pos:end], key)
            if call is None:
                return calls
            calls.append(call)
            self.done = end

    def flush(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        if cut_off and self.mode == "calls":
            rest = self.buffer[self.done:].lstrip().lstrip(";")
            call = _partial_call(rest, ("parameters", "arguments")) if rest.strip() else None
            self.buffer, self.prefix, self.done = "", "", 0
            return "", [call] if call else []
        # What follows the last whole call (all of it, when there was none) is content.
        rest = self.buffer[self.done:] if self.done else self.prefix + self.buffer
        self.buffer, self.prefix, self.done = "", "", 0
        return (rest if rest.strip() else ""), []


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _find_outside_strings(text: str, tag: str) -> int:
    """Where ``tag`` first stands in ``text`` outside its JSON strings (an end tag that a
    call's arguments spell, ``{"code": "</tool_call>"}``, is text), or -1; also -1 while
    a string is still open (more text may close it)."""
    pos = 0
    while (at := text.find(tag, pos)) >= 0:
        quote = text.find('"', pos, at)
        if quote < 0:
            return at
        string = _JSON_STRING.match(text, quote)
        if string is None:
            return -1
        pos = string.end()
    return -1


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise InputError(f"unknown tool-call parser {name!r}: choose one of "
                         f"{', '.join(PARSERS)}") from None
