"""Tools in a chat request: the conversation as the chat template takes it, and what the
request asks of the output.

:func:`template_messages` turns the request's messages into the dicts chat templates read
(an assistant's ``tool_calls`` with their arguments as objects, as Qwen's and Llama's
templates write them; a ``tool`` message's ``tool_call_id``). :func:`plan` decides, from
``tools``, ``tool_choice`` and ``parallel_tool_calls`` and the server's tool-call parser
(``spececd api --tool-call-parser``):

- ``tool_choice: "none"``: the template still shows the tools; the output is content;
- ``"auto"`` (the default with tools): the output is parsed for calls
  (:mod:`spececd.openai_api.tool_parsers`); generation itself is untouched, so it stays
  lossless and unconstrained (with ``parallel_tool_calls`` false, calls after the first
  are dropped);
- ``"required"`` or a named function: as auto, and the output is forced to be calls, in
  the parser's format, with arguments valid under each function's ``parameters`` schema:
  a grammar (:func:`call_grammar`, built by :func:`spececd.grammar.tagged_json_grammar`
  from xgrammar's structural tags, which embed the JSON schemas) passed as a ``grammar``
  :class:`~spececd.core.params.Constraint`, which the verifier masks the target with at
  every position, so the output is the target's own under that constraint. A named
  function is called once; ``required`` calls one when ``parallel_tool_calls`` is false,
  else one to as many as there are tools (:func:`max_forced_calls`): the grammar ends the
  output there, so a model that would repeat calls forever stops.

:func:`template_parser` reads which parser a model's chat template writes calls for, so
that ``spececd api`` needs no ``--tool-call-parser`` for such a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spececd.grammar import InvalidConstraint, tagged_json_grammar
from spececd.openai_api.schema import ChatRequest, FieldError, Message, NamedToolChoice
from spececd.openai_api.tool_parsers import PARSERS, ToolParser, parser

__all__ = ["CALL_FORMATS", "ToolPlan", "call_grammar", "max_forced_calls", "plan",
           "template_messages", "template_parser"]

# Per parser: how a call begins up to its arguments, how it ends, what separates calls;
# the templates of the models each parser serves write calls this way.
CALL_FORMATS: dict[str, tuple[str, str, str]] = {
    "hermes": ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": ('{{"name": "{name}", "parameters": ', "}", "; "),
}
assert set(CALL_FORMATS) == set(PARSERS)


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The request's messages as chat templates read them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": m.text()}
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as the templates render them (``arguments | tojson``): the
    object, not its JSON text (which would be rendered as a quoted string)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template
    parser: ToolParser | None  # calls are parsed out of the output
    grammar: str | None  # an EBNF grammar the output must match: calls only
    max_calls: int | None = None  # calls kept per choice (parallel_tool_calls false: 1)


def plan(body: ChatRequest, parser_name: str | None) -> ToolPlan:
    """What ``body``'s tools ask for, with the server's tool-call parser (None: none was
    configured, and a request with tools is refused)."""
    if not body.tools:
        return ToolPlan(None, None, None)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    choice = body.tool_choice or "auto"
    if choice == "none":
        return ToolPlan(tools, None, None)
    if parser_name is None:
        raise FieldError("tools", "this server parses no tool calls (the model's chat "
                         "template writes calls in no format it knows): start `spececd "
                         f"api` with --tool-call-parser ({' or '.join(PARSERS)}, the format "
                         "the model writes calls in), or send tool_choice \"none\"")
    other = body.constraint_field() if choice != "auto" else None
    if other is not None:
        what = f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) \
            else repr(choice)
        raise FieldError("tool_choice", f"tool_choice {what} forces a tool call, which "
                         f"cannot be combined with {other[0]}: send one or the other")
    grammar = None
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t["function"]["name"] == choice.function.name]
        grammar = call_grammar(parser_name, named, max_calls=1)
    elif choice == "required":
        grammar = call_grammar(parser_name, tools, max_forced_calls(
            tools, body.parallel_tool_calls))
    return ToolPlan(tools, parser(parser_name), grammar,
                    None if body.parallel_tool_calls else 1)


def max_forced_calls(tools: list[dict[str, Any]], parallel: bool) -> int:
    """The most calls ``tool_choice: "required"`` lets the output hold: one without
    parallel calls, else one per tool (a bound the model cannot talk past: nothing in the
    request says how many calls it wants, and a small model may never stop of itself)."""
    return max(len(tools), 1) if parallel else 1


def call_grammar(parser_name: str, tools: list[dict[str, Any]], max_calls: int = 1) -> str:
    """An EBNF grammar of one to ``max_calls`` calls, separated as the parser expects, to
    any of ``tools``, each call's arguments valid under its function's ``parameters`` (any
    object when it has none). A schema that cannot constrain a call is a
    :class:`FieldError` naming the function."""
    begin, end, separator = CALL_FORMATS[parser_name]
    tags = []
    for tool in tools:
        function = tool["function"]
        tag = (begin.format(name=function["name"]),
               function.get("parameters") or {"type": "object"}, end)
        try:  # each schema on its own, so that an error names its function
            tagged_json_grammar([tag], separator)
        except InvalidConstraint as exc:
            raise FieldError("tools", f"the parameters of tool {function['name']!r} are not "
                             f"a JSON schema a call can be constrained by: {exc}") from None
        tags.append(tag)
    return tagged_json_grammar(tags, separator, max_calls)


_PROBE_TOOL = {"type": "function", "function": {
    "name": "spececd_probe", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}}
_PROBE = [{"role": "user", "content": "?"},
          {"role": "assistant", "content": "", "tool_calls": [{
              "id": "call_0", "type": "function",
              "function": {"name": "spececd_probe", "arguments": {"x": 1}}}]}]


def template_parser(tokenizer: Any) -> str | None:
    """The tool-call parser whose format ``tokenizer``'s chat template writes an
    assistant's call in (a conversation with one call rendered and read back), or None:
    no template, one that takes no tools, or a format no parser reads."""
    try:
        ids = tokenizer.apply_chat_template(_PROBE, [_PROBE_TOOL])
    except Exception:  # a template that refuses tools or calls: none
        return None
    if ids is None:
        return None
    text = str(tokenizer.decode(list(ids)))
    for name in PARSERS:
        begin = CALL_FORMATS[name][0].format(name="spececd_probe")
        if begin in text and (name != "hermes" or "</tool_call>" in text):
            return name
    return None
