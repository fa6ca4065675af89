"""Clients no one here wrote, against `spececd api` on the default pair as a newcomer starts
it (no flag but the port): the openai SDK (a tool call whole and streamed, a tool round trip,
``parse``), instructor (its ``TOOLS``, ``JSON_SCHEMA`` and ``JSON`` modes) and litellm
(plain, streamed, tools). Each asserts a validated object or a valid call.

The pair was trained on source code, so what makes its answers valid is the server: the
chat template renders tools, the parser is read from it, a forced call is masked by its
grammar, a schema without ``strict`` is compiled strictly (as vLLM compiles it). What the
model says inside a valid object is its own affair: nothing here checks that Jason is 25.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel  # noqa: E402

from tests.builders import requires_default_pair  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402

pytestmark = requires_default_pair

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": WEATHER_PARAMETERS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class User(BaseModel):
    name: str
    age: int


class Reply(BaseModel):
    """What instructor's JSON mode can get from a model that reads no instructions: the
    mode puts the schema in the prompt only, and the response format allows any object
    (as vLLM's does), so a schema whose fields all have defaults is what a valid object
    from this model satisfies."""

    name: str = ""
    age: int = 0


@pytest.fixture(scope="module")
def api() -> Iterator[ServerProcess]:
    proc = ServerProcess(None, command="api", scheme="http")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(api: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)


def check_call(name: str, arguments: str) -> dict[str, Any]:
    assert name == "get_weather"
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER_PARAMETERS)
    return dict(args)


def test_the_server_reads_the_tool_call_format_from_the_template(api: ServerProcess) -> None:
    assert any("tool calls parsed as hermes (the chat template's)" in line
               for line in api.log)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_sdk_tool_round_trip(client: Any, stream: bool) -> None:
    request: dict[str, Any] = dict(model="spececd", messages=ASK, tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_tokens=60)
    if stream:
        calls: list[dict[str, str]] = []
        finish = None
        for chunk in client.chat.completions.create(stream=True, **request):
            choice = chunk.choices[0]
            for part in choice.delta.tool_calls or ():
                if part.id is not None:
                    calls.append({"id": part.id, "name": part.function.name,
                                  "arguments": ""})
                calls[part.index]["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    else:
        reply = client.chat.completions.create(**request)
        finish = reply.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in reply.choices[0].message.tool_calls or ()]
    assert finish == "tool_calls" and len(calls) == 1  # one tool: one call, then the end
    check_call(calls[0]["name"], calls[0]["arguments"])
    said = {"role": "assistant", "content": None, "tool_calls": [{
        "id": calls[0]["id"], "type": "function",
        "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]}
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"celsius": 21}'}
    final = client.chat.completions.create(model="spececd", messages=[*ASK, said, result],
                                           tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert isinstance(final.choices[0].message.content, str)
    assert not final.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_cut_off_by_max_tokens_is_a_call_never_content(client: Any,
                                                              stream: bool) -> None:
    """As vLLM and OpenAI report one: finish_reason length, the call with the arguments
    written so far once its name is whole, and no `<tool_call>` text for a user to see."""
    request: dict[str, Any] = dict(model="spececd", messages=ASK, tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_tokens=14)
    if stream:
        content, names, finish = "", [], None
        for chunk in client.chat.completions.create(stream=True, **request):
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            names += [p.function.name for p in choice.delta.tool_calls or () if p.id]
            finish = choice.finish_reason or finish
    else:
        reply = client.chat.completions.create(**request)
        content = reply.choices[0].message.content or ""
        names = [c.function.name for c in reply.choices[0].message.tool_calls or ()]
        finish = reply.choices[0].finish_reason
    assert finish == "length" and content == ""
    assert names in ([], ["get_weather"])


def reply_call(client: Any, stream: bool, **request: Any) -> tuple[str, list[dict[str, str]]]:
    """The finish reason and the calls of a chat reply, whole or assembled from its
    stream."""
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        return choice.finish_reason, [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or ()]
    calls: list[dict[str, str]] = []
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **request):
        for part in chunk.choices[0].delta.tool_calls or ():
            if part.id is not None:
                calls.append({"name": part.function.name, "arguments": ""})
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return finish, calls


def test_a_cut_call_carries_a_start_of_its_own_arguments(client: Any) -> None:
    """Cut by max_tokens where the call closes (the arguments' last tokens, the call's
    closing brace, the end tag's pieces), whole and streamed: the arguments are a start of
    the whole call's, never with the text that wraps them (every other cut:
    test_tool_parsers.py)."""
    request: dict[str, Any] = dict(model="spececd", messages=ASK, tools=[WEATHER],
                                   tool_choice="required", temperature=0)
    whole = client.chat.completions.create(max_tokens=60, **request)
    (call,) = whole.choices[0].message.tool_calls
    arguments, spent = call.function.arguments, whole.usage.completion_tokens
    for max_tokens in range(max(spent - 6, 1), spent):
        for stream in (False, True):
            finish, calls = reply_call(client, stream, max_tokens=max_tokens, **request)
            assert finish == "length", (max_tokens, stream)
            assert len(calls) <= 1 and all(
                c["name"] == "get_weather" and arguments.startswith(c["arguments"])
                for c in calls), (max_tokens, stream, calls, arguments)


def test_openai_sdk_parse(client: Any) -> None:
    reply = client.chat.completions.parse(
        model="spececd", messages=[{"role": "user", "content": "Jason is 25 years old."}],
        response_format=User, temperature=0, max_tokens=60)
    assert isinstance(reply.choices[0].message.parsed, User)


@pytest.mark.parametrize("mode,model", [("TOOLS", User), ("JSON_SCHEMA", User),
                                        ("JSON", Reply)])
def test_instructor_modes(client: Any, mode: str, model: type[BaseModel]) -> None:
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    got = patched.chat.completions.create(
        model="spececd", response_model=model, temperature=0, max_tokens=60, max_retries=0,
        messages=[{"role": "user", "content": "Jason is 25 years old."}])
    assert isinstance(got, model)


@pytest.fixture(scope="module")
def litellm() -> Any:
    # The model price list from the package, not the network (none here, nor needed).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    module = pytest.importorskip("litellm")
    module.telemetry = False
    return module


def litellm_args(api: ServerProcess) -> dict[str, Any]:
    return dict(model="openai/spececd", api_base=f"{api.url}/v1", api_key="none",
                temperature=0, num_retries=0)


def test_litellm_plain_and_streamed(litellm: Any, api: ServerProcess) -> None:
    messages = [{"role": "user", "content": "def main():"}]
    whole = litellm.completion(messages=messages, max_tokens=12, **litellm_args(api))
    text = whole.choices[0].message.content
    assert isinstance(text, str) and whole.usage.completion_tokens > 0
    pieces = [chunk.choices[0].delta.content or "" for chunk in litellm.completion(
        messages=messages, max_tokens=12, stream=True, **litellm_args(api))]
    assert "".join(pieces) == text  # greedy: the same reply, streamed


def test_litellm_tools(litellm: Any, api: ServerProcess) -> None:
    reply = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required",
                               max_tokens=60, **litellm_args(api))
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    check_call(calls[0].function.name, calls[0].function.arguments)
