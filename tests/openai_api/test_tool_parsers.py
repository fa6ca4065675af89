"""The tool-call parsers on outputs as the models write them: whole, and fed in pieces of
every size (calls split across stream chunks), which must give the same content and
calls."""

from __future__ import annotations

import json

import pytest

from spececd.errors import InputError
from spececd.openai_api.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    ToolParser,
    parser,
)

# Qwen2.5-7B-Instruct's way: a call per block, a newline between blocks.
QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
    '"San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>')
QWEN_TEXT_THEN_CALL = (
    'Let me look that up.\n<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\"'
    ' </tool> {brace}"}}\n</tool_call>')
# Llama 3.1-8B-Instruct's way: the reply is the JSON object.
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def streamed(p: ToolParser, text: str, size: int) -> tuple[str | None, list[ToolCall]]:
    stream = p.stream()
    content, calls = "", []
    for piece in pieces(text, size):
        more, new = stream.push(piece)
        content += more
        calls += new
    more, new = stream.flush()
    return (content + more) or None, calls + new


def named(calls: list[ToolCall]) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
def test_hermes_several_calls(size: int) -> None:
    content, calls = streamed(HermesParser(), QWEN_TWO_CALLS, size)
    assert content is None
    assert named(calls) == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01",
                                  "unit": "celsius"})]
    assert calls[0].arguments == ('{"location": "San Francisco, CA, USA", "unit": '
                                  '"celsius"}')  # the model's own text
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_hermes_text_before_a_call_is_content(size: int) -> None:
    content, calls = streamed(HermesParser(), QWEN_TEXT_THEN_CALL, size)
    assert content == "Let me look that up.\n"
    assert named(calls) == [("search", {"q": 'a "quoted" </tool> {brace}'})]


@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_hermes_an_end_tag_inside_the_arguments_is_text(size: int) -> None:
    """A call whose arguments spell the end tag (code that writes tool calls) ends at the
    tag after its JSON, not at the one inside its string."""
    text = ('<tool_call>\n{"name": "write", "arguments": {"code": "print(\'</tool_call>\')",'
            ' "n": "\\"</tool_call>"}}\n</tool_call>\nDone.')
    content, calls = streamed(HermesParser(), text, size)
    assert named(calls) == [("write", {"code": "print('</tool_call>')", "n": '"</tool_call>'})]
    assert content == "Done."


@pytest.mark.parametrize("size", [1, 5, 10_000])
def test_hermes_malformed_json_is_left_as_content(size: int) -> None:
    bad = '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'  # a brace short
    text = f"{bad}\n{QWEN_TWO_CALLS}"
    content, calls = streamed(HermesParser(), text, size)
    assert content == bad + "\n"
    assert [c.name for c in calls] == ["get_current_temperature", "get_temperature_date"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n["f"]\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',  # cut off before its end tag
    "plain text with a < and <tool but no call",
])
def test_hermes_what_is_not_a_call_is_content(text: str) -> None:
    assert HermesParser().parse(text) == (text, [])
    assert streamed(HermesParser(), text, 1) == (text, [])


def test_hermes_holds_back_only_what_may_open_a_call() -> None:
    stream = HermesParser().stream()
    assert stream.push("Sure <tool") == ("Sure ", [])  # "<tool" may open a call
    assert stream.push("s> are ready") == ("<tools> are ready", [])
    assert stream.flush() == ("", [])


def test_hermes_a_call_without_arguments_gets_an_empty_object() -> None:
    _, calls = HermesParser().parse('<tool_call>\n{"name": "now"}\n</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")]


@pytest.mark.parametrize("size", [1, 3, 10_000])
@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", " \n"])
def test_llama3_json_call(prefix: str, size: int) -> None:
    content, calls = streamed(Llama3JsonParser(), prefix + LLAMA_CALL, size)
    assert content is None
    assert named(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert calls[0].arguments == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("size", [1, 10_000])
def test_llama3_json_several_calls_separated_by_semicolons(size: int) -> None:
    text = LLAMA_CALL + '; {"name": "get_time", "parameters": {}}'
    _, calls = streamed(Llama3JsonParser(), text, size)
    assert [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '{"name": "get_weather", "parameters": {"city": "Paris"',  # cut off
    '{"city": "Paris"}',  # JSON, but no call
    "<|python_tag|>not json",
])
def test_llama3_json_what_is_not_a_call_is_content(text: str) -> None:
    assert Llama3JsonParser().parse(text) == (text, [])
    assert streamed(Llama3JsonParser(), text, 1) == (text, [])


def test_llama3_json_text_after_a_call_is_content() -> None:
    assert named(Llama3JsonParser().parse(LLAMA_CALL + " done")[1]) == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert Llama3JsonParser().parse(LLAMA_CALL + " done")[0] == " done"


@pytest.mark.parametrize("name,text,want", [
    # Cut within the name: nothing to report yet (vLLM streams a call once its name is).
    ("hermes", '<tool_call>\n{"name": "get_weath', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     [("get_weather", '{"city": "Pa')]),
    ("hermes", QWEN_TEXT_THEN_CALL[:-len("}\n</tool_call>")],
     [("search", '{"q": "a \\"quoted\\" </tool> {brace}"}')]),
    ("llama3_json", LLAMA_CALL + '; {"name": "get_time", "parameters": {"tz"',
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz"')]),
])
@pytest.mark.parametrize("size", [1, 10_000])
def test_a_call_cut_off_by_the_token_limit_is_a_call_never_content(
        name: str, text: str, want: list[tuple[str, str]], size: int) -> None:
    """At the token limit the unfinished call comes back as a call with the arguments
    written so far, as OpenAI and vLLM report one; at a stop it would be content."""
    stream = parser(name).stream()
    content, calls = "", []
    for piece in pieces(text, size):
        more, new = stream.push(piece)
        content, calls = content + more, calls + new
    more, new = stream.flush(cut_off=True)
    assert "<tool_call>" not in content + more and "get_" not in content + more
    assert [(c.name, c.arguments) for c in calls + new] == want
    assert parser(name).parse(text)[0]  # the same text, ended by a stop: content


# Per parser: text the model writes, and the calls in it (name, arguments text); the
# arguments hold every kind of JSON token, nested, and what wraps each call ends in
# brackets and tags that a cut could leave behind.
WRITTEN = {
    "hermes": (
        'Sure.\n<tool_call>\n{"name": "pname", "arguments": {"name": "pname"\n, "age": 100}}'
        '\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {"s": "a}\\"]\\n",'
        ' "n": -1.5e+3, "l": [true, false, null, {}, []], "o": {"k": [0]}}}\n</tool_call>',
        [("pname", '{"name": "pname"\n, "age": 100}'),
         ("f", '{"s": "a}\\"]\\n", "n": -1.5e+3, "l": [true, false, null, {}, []], '
               '"o": {"k": [0]}}')]),
    "llama3_json": (
        '<|python_tag|>{"name": "pname", "parameters": {"name": "pname", "age": 100}}; '
        '{"name": "f", "parameters": {"s": "a}\\";", "n": -1.5e+3, "l": [true, false, null, '
        '{}, []], "o": {"k": [0]}}}',
        [("pname", '{"name": "pname", "age": 100}'),
         ("f", '{"s": "a}\\";", "n": -1.5e+3, "l": [true, false, null, {}, []], '
               '"o": {"k": [0]}}')]),
}


@pytest.mark.parametrize("name", list(WRITTEN))
@pytest.mark.parametrize("size", [1, 5, 10_000], ids=["by-char", "by-5", "whole"])
def test_a_cut_anywhere_leaves_arguments_that_start_the_calls_own(name: str,
                                                                  size: int) -> None:
    """Cut at every position of the text, the calls handed back are the whole calls before
    the cut and then, once its name is whole, the cut one, whose arguments are a start of
    its own arguments' text: never a brace, a separator or a tag of the text around it,
    whether the text came whole or streamed in pieces."""
    text, written = WRITTEN[name]
    before = text[:text.index("{")]  # content, or the python tag
    assert [(c.name, c.arguments) for c in parser(name).parse(text)[1]] == written
    for cut in range(len(text) + 1):
        stream = parser(name).stream()
        content, calls = "", []
        for piece in pieces(text[:cut], size):
            more, new = stream.push(piece)
            content, calls = content + more, calls + new
        more, new = stream.flush(cut_off=True)
        content, calls = content + more, calls + new
        assert len(calls) <= len(written), (cut, calls)
        for (want_name, want_arguments), call in zip(written, calls, strict=False):
            assert call.name == want_name, (cut, call)
            assert want_arguments.startswith(call.arguments), (cut, call.arguments)
        assert all(c.arguments == args for c, (_, args) in zip(calls[:-1], written,
                                                              strict=False)), cut
        # (a reply cut within Llama's python tag is undecided: it is content)
        assert before.startswith(content), (cut, content)
        assert not content or name == "hermes" or cut < len(before), (cut, content)


@pytest.mark.parametrize("written,kept", [
    ('{"a": 01}', '{"a": 0'),  # a number goes on no further than JSON lets it
    ('{"a": 1.', '{"a": 1.'), ('{"a": 1.5e-', '{"a": 1.5e-'), ('{"a": -', '{"a": -'),
    ('{"a": tr', '{"a": tr'), ('{"a": tx', '{"a":'), ('{"a": "\\u12', '{"a": "\\u12'),
    ('{"a": "\\x"', '{"a":'), ('{"a" 1}', '{"a"'), ('{"a": "x" 5', '{"a": "x"'),
    ('{"a": [1,]', '{"a": [1,'), ('{"a":}', '{"a":'), ('{1', "{"), ('[1]', ""),
    ('"s"', ""), ('{"a": {"b": 2}}}\n</tool_c', '{"a": {"b": 2}}'), ('{"a": 1 ', '{"a": 1 '),
])
def test_cut_arguments_keep_what_is_json_and_no_more(written: str, kept: str) -> None:
    """What a model wrote that stops being JSON is cut where it stops: the arguments
    handed back are always the start of a JSON object."""
    stream = parser("hermes").stream()
    assert stream.push(f'<tool_call>{{"name": "f", "arguments": {written}') == ("", [])
    (call,) = stream.flush(cut_off=True)[1]
    assert call.arguments == kept


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(InputError, match="hermes, llama3_json"):
        parser("mistral")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
    "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>', '<tool_call>\n{"name": "now", "arguments": {"tz": 1}}\n'
               '</tool_call>', "\n"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "now", "parameters": {"tz": 1}}', "; "),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_the_call_grammar_takes_what_the_parser_parses(name: str) -> None:
    """The grammar that forces calls (tool_choice required or named) writes them in the
    parser's format: what it accepts parses back, and it refuses what breaks the schema,
    a second call when calls are not parallel, a call past the bound when they are (so
    the output ends), and text around a call."""
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from spececd.openai_api.tools import call_grammar

    one, other, separator = CALLS[name]
    parallel = xgrammar.Grammar.from_ebnf(call_grammar(name, [WEATHER, NOW], max_calls=2))
    single = xgrammar.Grammar.from_ebnf(call_grammar(name, [WEATHER, NOW], max_calls=1))
    both = one + separator + other
    assert _is_grammar_accept_string(parallel, both)
    assert _is_grammar_accept_string(parallel, one)
    assert not _is_grammar_accept_string(parallel, both + separator + one)
    assert [c.name for c in parser(name).parse(both)[1]] == ["get_weather", "now"]
    assert _is_grammar_accept_string(single, one) and _is_grammar_accept_string(single, other)
    assert not _is_grammar_accept_string(single, both)
    assert not _is_grammar_accept_string(parallel, one.replace("Paris", "Rome"))
    assert not _is_grammar_accept_string(parallel, "Sure. " + one)
    assert not _is_grammar_accept_string(parallel, "")
