"""Structured outputs, and OpenAI's request fields and errors, through the OpenAI API in
process (the official client over Starlette's test client, the tiny pair):

- ``response_format`` with a Pydantic model parses, vLLM's ``structured_outputs`` and
  ``guided_*`` fields constrain the output, and a bad constraint is a 400 naming the field,
  after which the server goes on serving; with no xgrammar, a constraint's 400 names the
  extra that installs it;
- the fields of OpenAI's chat request that change nothing here (``store``, ``metadata``,
  ``service_tier``, ``reasoning_effort``, ...) are taken and ignored, as vLLM takes them:
  the reply is the one without them; those that ask for what SpecECD does not do (audio,
  web search, moderation, the deprecated ``functions``) are refused naming the field; a
  ``null`` is the field left out;
- a prompt past the context gets OpenAI's context-overflow error (its words and its code
  ``context_length_exceeded``), as ``max_tokens`` past it does;
- a value pydantic refuses reads without pydantic's inner names, ``param`` its path.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from pydantic import BaseModel, Field  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from spececd import grammar  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from spececd.openai_api.schema import IGNORED, ChatRequest  # noqa: E402
from spececd.openai_api.server import Api, create_app  # noqa: E402
from tests.builders import REPO  # noqa: E402


class Point(BaseModel):
    label: str = Field(max_length=5)
    x: int = Field(ge=0, le=9)
    on: bool


@pytest.fixture(scope="module")
def http(tiny_models: dict[str, Path]) -> Iterator[TestClient]:
    gen = Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu",
                         dtype="float32", k=4)
    with TestClient(create_app(Api(gen, "spececd"))) as client:
        yield client
    gen.close()


@pytest.fixture(scope="module")
def client(http: TestClient) -> Any:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                         max_retries=0)


def test_parse_with_a_pydantic_model_returns_a_parsed_object(client: Any) -> None:
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.parse(
            model="spececd", messages=[{"role": "user", "content": "a point"}],
            response_format=Point, max_tokens=60, temperature=temperature, seed=3)
        parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, Point) and 0 <= parsed.x <= 9
        assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: len(t) == 3 and t.isdigit()),
    ({"guided_regex": "(ab)+c"}, lambda t: t.startswith("ab") and t.endswith("c")),
    ({"guided_grammar": 'root ::= "x" | "y" "z"'}, lambda t: t in ("x", "yz")),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "boolean"}},
                      "required": ["a"]}}, lambda t: isinstance(json.loads(t)["a"], bool)),
    # The tiny model never closes an object it may fill at will: its start shows the mask.
    ({"response_format": {"type": "json_object"}, "max_tokens": 4},
     lambda t: t.startswith('{"')),
])
def test_vllm_and_openai_fields_constrain_the_output(http: TestClient, body: dict[str, Any],
                                                     check: Any) -> None:
    reply = http.post("/v1/completions", json={
        "model": "spececd", "prompt": "x = ", "max_tokens": 16, "temperature": 0, **body})
    assert reply.status_code == 200, reply.json()
    assert check(reply.json()["choices"][0]["text"])


@pytest.mark.parametrize("body,param,says", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "p", "schema": {"type": "nope"}}}},
     "response_format", "invalid json_schema constraint"),
    ({"guided_regex": "(ab"}, "guided_regex", "invalid regex constraint"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar",
     "invalid grammar constraint"),
    ({"guided_choice": []}, "guided_choice", "non-empty JSON list of strings"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
])
def test_a_bad_constraint_is_a_400_and_the_server_goes_on(
        http: TestClient, body: dict[str, Any], param: str, says: str) -> None:
    reply = http.post("/v1/chat/completions", json={
        "model": "spececd", "messages": [{"role": "user", "content": "hi"}], **body})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"]
    fine = http.post("/v1/completions", json={"model": "spececd", "prompt": "x",
                                              "max_tokens": 3})
    assert fine.status_code == 200


def test_a_schema_without_strict_is_compiled_strictly_as_vllm_does(http: TestClient) -> None:
    """instructor's JSON_SCHEMA mode sends no ``strict``: as in vLLM, the object then holds
    the schema's properties only, so it closes and the output ends. ``strict: false``
    (OpenAI's meaning: other properties allowed) lets this model add keys until the
    limit."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}

    def choices(**strict: bool) -> list[dict[str, Any]]:
        reply = http.post("/v1/chat/completions", json={
            "model": "spececd", "messages": [{"role": "user", "content": "a"}], "n": 4,
            "temperature": 1.0, "seed": 5, "max_tokens": 24, "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema, **strict}}})
        assert reply.status_code == 200, reply.json()
        return list(reply.json()["choices"])

    for strict in ({}, {"strict": True}):
        for choice in choices(**strict):
            assert choice["finish_reason"] == "stop"
            assert set(json.loads(choice["message"]["content"])) == {"a"}
    assert any(c["finish_reason"] == "length" for c in choices(strict=False))


def test_limits_are_400s_naming_the_field(http: TestClient) -> None:
    """A prompt and max_tokens past the context, and a prompt past it alone, are refused
    as OpenAI and vLLM refuse them (not shortened), with ``param`` set; a check across
    fields reads as a sentence, without pydantic's "Value error, "."""
    context = http.app.state.api.gen.max_context
    prompt = [5] * (context // 2)
    reply = http.post("/v1/completions", json={"model": "spececd", "prompt": prompt,
                                               "max_tokens": context})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "max_tokens"
    assert f"maximum context length is {context} tokens" in error["message"]
    assert f"{len(prompt)} in the prompt, {context} for the completion" in error["message"]
    fits = http.post("/v1/completions", json={"model": "spececd", "prompt": prompt,
                                              "max_tokens": context - len(prompt)})
    assert fits.status_code == 200
    reply = http.post("/v1/chat/completions", json={
        "model": "spececd", "messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": context})
    assert reply.json()["error"]["param"] == "max_completion_tokens"
    reply = http.post("/v1/completions", json={"model": "spececd", "prompt": [5] * context})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    reply = http.post("/v1/chat/completions", json={
        "model": "spececd", "messages": [{"role": "user", "content": "x " * context}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    reply = http.post("/v1/chat/completions", json={
        "model": "spececd", "messages": [{"role": "user"}]})
    error = reply.json()["error"]
    assert error["param"] == "messages[0]" and "Value error" not in error["message"]
    assert error["message"].startswith("messages[0]: a user message needs content")


def test_echo_with_healing_asked_is_a_400_naming_token_healing(http: TestClient) -> None:
    """Echo returns the prompt's own tokens, which healing would change (the prompt's
    log-probabilities would then be one short of its tokens: a 500 before this check)."""
    reply = http.post("/v1/completions", json={
        "model": "spececd", "prompt": "def main():\n", "echo": True, "logprobs": 1,
        "max_tokens": 0, "token_healing": True})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "token_healing"


ASK = [{"role": "user", "content": "def main():"}]


def refusal(call: Any) -> Any:
    """The body of the 400 that ``call`` gets."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.body


def test_openais_other_fields_are_taken_and_ignored(client: Any) -> None:
    """Sent the way the openai client sends them (its own keyword arguments), the reply is
    the one without them, whole and streamed."""
    plain = dict(model="spececd", messages=ASK, max_tokens=8, temperature=0)
    ignored = dict(store=True, metadata={"run": "7"}, service_tier="flex",
                   reasoning_effort="low", verbosity="low", prompt_cache_key="k",
                   prompt_cache_retention="24h", safety_identifier="user-1", user="user-1",
                   modalities=["text"])
    want = client.chat.completions.create(**plain).choices[0].message.content
    assert want
    assert client.chat.completions.create(**plain, **ignored).choices[0].message.content == want
    chunks = client.chat.completions.create(
        **plain, **ignored, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_the_ignored_fields_are_chat_fields_and_documented() -> None:
    guide = (REPO / "docs" / "guide" / "openai-api.md").read_text()
    for name in IGNORED:
        assert name.partition(".")[0] in ChatRequest.model_fields, name
        assert f"`{name}`" in guide, f"{name} is not in the guide"


@pytest.mark.parametrize("fields,param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_fields_asking_for_what_spececd_does_not_do_are_refused_by_name(
        client: Any, fields: dict[str, Any], param: str) -> None:
    body = refusal(lambda: client.chat.completions.create(
        model="spececd", messages=ASK, max_tokens=4, **fields))
    assert body["param"] == param and body["code"] == "unsupported_parameter"
    assert f"leave {param} out" in body["message"]


def test_moderation_is_refused(http: TestClient) -> None:
    reply = http.post("/v1/chat/completions", json={
        "model": "spececd", "messages": ASK, "moderation": {"model": "omni-moderation"}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "moderation"


def test_a_null_is_the_field_left_out(client: Any) -> None:
    plain = dict(model="spececd", messages=ASK, max_tokens=8, seed=1)
    nulls = dict(temperature=None, top_p=None, n=None, presence_penalty=None,
                 frequency_penalty=None, logprobs=None, stream=None, parallel_tool_calls=None)
    want = client.chat.completions.create(**plain).choices[0].message.content
    assert client.chat.completions.create(**plain, **nulls).choices[0].message.content == want


def test_a_prompt_past_the_context_is_openais_context_overflow(http: TestClient,
                                                              client: Any) -> None:
    """The wording and code frameworks look for: for the prompt alone, and for the prompt
    with max_tokens (messages or prompt; the parameter to change named)."""
    context = http.app.state.api.gen.max_context  # type: ignore[attr-defined]
    long = [{"role": "user", "content": "x " * context}]
    cases = [
        (lambda: client.chat.completions.create(model="spececd", messages=long), "messages",
         "your messages resulted in"),
        (lambda: client.chat.completions.create(model="spececd", messages=long,
                                                max_tokens=5), "messages",
         "in the messages, 5 for the completion"),
        (lambda: client.completions.create(model="spececd", prompt=[5] * context,
                                           max_tokens=3), "prompt",
         f"requested {context + 3} tokens ({context} in the prompt, 3 for the completion)"),
        (lambda: client.completions.create(model="spececd", prompt="x", max_tokens=context),
         "max_tokens", f"or max_tokens to at most {context - 1}."),
    ]
    for call, param, says in cases:
        body = refusal(call)
        assert body["code"] == "context_length_exceeded" and body["param"] == param, body
        assert body["message"].startswith(
            f"This model's maximum context length is {context} tokens. However, "), body
        assert says in body["message"], body


@pytest.mark.parametrize("fields,param,says", [
    ({"tool_choice": "maybe"}, "tool_choice",
     "tool_choice: Input should be 'none', 'auto' or 'required', or an object "
     '{"type": "function", "function": {"name": ...}}'),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function",
     "Missing required parameter: 'tool_choice.function'."),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:,"}}]}]}, "messages[0].content[0].type",
     "messages[0].content[0].type: Input should be 'text'"),
    ({"stop": 5}, "stop", "stop: Input should be a valid string, or a valid list"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name",
     "Missing required parameter: 'response_format.json_schema.name'."),
])
def test_validation_errors_name_the_field_without_pydantics_inner_names(
        http: TestClient, fields: dict[str, Any], param: str, says: str) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    reply = http.post("/v1/chat/completions", json={
        "model": "spececd", "messages": ASK, "tools": tools, **fields})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param
    assert error["message"] == says
    assert not re.search(r"literal\[|NamedToolChoice|list\[|function-after", error["message"])


def test_a_constraint_without_xgrammar_names_the_extra_to_install(
        http: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar: ImportError
    monkeypatch.setattr(grammar, "_grammars", {})  # none built before
    reply = http.post("/v1/chat/completions", json={
        "model": "spececd", "messages": ASK, "max_tokens": 4,
        "response_format": {"type": "json_object"}})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "response_format"
    assert "need xgrammar, which SpecECD's `hf` extra installs" in error["message"]
