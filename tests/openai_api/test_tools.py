"""Tool calls through `spececd api`, in process, with the official `openai` client: a
random-init Qwen2 pair on Qwen2.5's real vocabulary and chat template
(:func:`tests.builders.qwen25_tokenizer`), served with ``tool_parser="hermes"``.

A random model never calls a tool of its own accord, so the calls here are forced
(``tool_choice`` a named function, or ``required``): the grammar of the call, masked by the
verifier, makes even this model write a valid one, which the parser then hands back. The
round trip (call, tool result, final answer) is checked streamed and not, and the prompts
against the template's own rendering of the same conversation; the chat templates of a
transformers tokenizer and of a GGUF (llama.cpp) render tools alike.

The vocabulary and templates come from llama-cpp-python's source archive, fetched with pip
once into a cache (:func:`tests.builders.llama_cpp_models`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402

from spececd.backends.hf_tokenizer import HFTokenizer  # noqa: E402
from spececd.errors import InputError  # noqa: E402
from spececd.generator import Generator, StreamChunk  # noqa: E402
from spececd.openai_api.schema import ChatRequest  # noqa: E402
from spececd.openai_api.server import Api, create_app  # noqa: E402
from spececd.openai_api.tools import plan  # noqa: E402
from tests.builders import (  # noqa: E402
    build_model,
    llama31_tokenizer,
    llama_cpp_models,
    qwen25_tokenizer,
    train_tokenizer,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def models() -> Path:
    return llama_cpp_models()


@pytest.fixture(scope="module")
def tokenizer(models: Path) -> Any:
    return qwen25_tokenizer(models)


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Iterator[Generator]:
    root = tmp_path_factory.mktemp("qwen-tools")
    target = build_model("qwen2", root / "target", tokenizer, seed=30, context=1024)
    draft = build_model("qwen2", root / "draft", tokenizer, seed=31, layers=1, hidden=32,
                        context=1024)
    with Generator.load(str(draft), str(target), device="cpu", dtype="float32",
                        threads=1) as loaded:
        yield loaded


APIS: list[Api] = []


def client_for(gen: Generator, tool_parser: str | None = "hermes") -> Any:
    api = Api(gen, "qwen", tool_parser=tool_parser)
    APIS.append(api)
    http = TestClient(create_app(api), raise_server_exceptions=False)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                         http_client=http)


@pytest.fixture(scope="module")
def client(gen: Generator) -> Iterator[Any]:
    yield client_for(gen)
    for api in APIS:
        api.executor.shutdown(wait=True)


def rendered(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
             ) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


def streamed_reply(client: Any, **request: Any) -> tuple[str, list[dict[str, Any]], str]:
    """The content, the calls and the finish reason of a streamed reply, assembled from
    its deltas as OpenAI's documentation does it, checking their shape on the way."""
    content, calls, finish = "", [], ""
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            if part.id is not None:  # a new call: its id and name, before any arguments
                assert part.index == len(calls) and part.id.startswith("call_")
                calls.append({"id": part.id, "name": part.function.name, "arguments": ""})
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def check_weather_call(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    assert name == "get_weather"
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Tokyo", "Lima")
    assert args["unit"] in ("celsius", "fahrenheit")
    return dict(args)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_round_trip(client: Any, tokenizer: Any, stream: bool) -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    request: dict[str, Any] = dict(model="qwen", messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice=forced, temperature=0, max_tokens=60)
    if stream:
        content, calls, finish = streamed_reply(client, **request)
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
        assert len(calls) == 1
        said: Any = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]}
    else:
        reply = client.chat.completions.create(**request)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        content = message.content or ""
        assert len(message.tool_calls) == 1
        call = message.tool_calls[0]
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
        assert call.type == "function" and call_id.startswith("call_")
        assert reply.usage.prompt_tokens == len(rendered(tokenizer, ASK, [WEATHER, TIME]))
        said = message  # sent back as the client returned it
    assert finish == "tool_calls" and content == ""
    args = check_weather_call(name, arguments)
    print(f"call ({'streamed' if stream else 'whole'}): {name}({arguments})")

    # The tool's result goes back, with the assistant's call, for the final answer.
    result = {"role": "tool", "tool_call_id": call_id,
              "content": json.dumps({"temperature": 21, **args})}
    final = client.chat.completions.create(model="qwen", messages=[*ASK, said, result],
                                           tools=[WEATHER, TIME], temperature=0,
                                           max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(final.choices[0].message.content, str)
    # The template saw the call (arguments as an object, as Qwen's template writes them)
    # and the result.
    template_view = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        result]
    assert final.usage.prompt_tokens == len(rendered(tokenizer, template_view,
                                                     [WEATHER, TIME]))


def test_required_without_parallel_calls_makes_exactly_one_call(client: Any) -> None:
    reply = client.chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    args = json.loads(calls[0].function.arguments)
    assert (calls[0].function.name, set(args)) in (("get_weather", {"city", "unit"}),
                                                    ("get_time", {"zone"}))


def test_sampled_forced_calls_are_valid_in_every_choice(client: Any) -> None:
    """At temperature 1 a random model strays anywhere it may: the grammar keeps each of
    the choices a call to one of the tools with arguments its schema allows. Room for long
    strays (a city's name is any string): a pass's float rounding depends on what else it
    batched, so under load a sample may take another path, and once one ran past 60
    tokens."""
    reply = client.chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=3, n=4, max_tokens=200)
    seen = set()
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        args = json.loads(call.arguments)
        if call.name == "get_weather":
            check_weather_call(call.name, call.arguments)
        else:
            assert call.name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})
        seen.add(call.arguments)
    assert len(seen) > 1  # sampled, not one answer four times


def bad_request(client: Any, **request: Any) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="qwen", max_tokens=4, **request)
    return str(caught.value.body["message"])


def test_bad_tool_requests_are_400s_that_say_why(client: Any, tmp_path: Path) -> None:
    forced = {"type": "function", "function": {"name": "get_stock"}}
    assert "not among tools" in bad_request(client, messages=ASK, tools=[WEATHER],
                                            tool_choice=forced)
    with pytest.raises(openai.BadRequestError) as caught:  # the field, in plain words
        client.chat.completions.create(model="qwen", max_tokens=4, messages=ASK,
                                       tools=[WEATHER], tool_choice=forced)
    assert caught.value.body["param"] == "tool_choice"
    assert caught.value.body["message"].startswith("tool_choice names the function")
    assert "tools is empty" in bad_request(client, messages=ASK, tool_choice="required")
    assert "tool_call_id" in bad_request(client, messages=[
        *ASK, {"role": "tool", "content": "21"}], tools=[WEATHER])
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}
    assert "tool 'broken'" in bad_request(client, messages=ASK, tools=[broken],
                                          tool_choice="required")
    assert "cannot be combined with response_format" in bad_request(
        client, messages=ASK, tools=[WEATHER], tool_choice="required",
        response_format={"type": "json_object"})
    # A model without a chat template: no parser to read from it.
    plain_model = build_model("llama", tmp_path / "plain", train_tokenizer(300), seed=5)
    with Generator.load(str(plain_model), str(plain_model), device="cpu", dtype="float32",
                        threads=1) as plain:
        refused = client_for(plain, None)
        assert "--tool-call-parser" in bad_request(refused, messages=ASK, tools=[WEATHER])
        with pytest.raises(openai.BadRequestError) as caught:
            refused.chat.completions.create(model="qwen", max_tokens=4, messages=ASK,
                                            tools=[WEATHER])
        assert caught.value.body["param"] == "tools"


def test_the_parser_is_read_from_the_chat_template(gen: Generator) -> None:
    """Without --tool-call-parser, the format the template writes an assistant's call in:
    Qwen2.5's writes Hermes blocks."""
    assert Api(gen, "qwen").tool_parser == "hermes"
    assert Api(gen, "qwen", tool_parser="llama3_json").tool_parser == "llama3_json"


def test_a_template_that_cannot_take_tools_is_refused(models: Path, tokenizer: Any) -> None:
    from llama_cpp import Llama

    # The GGUF's own template (Qwen1.5's) never reads `tools`.
    gguf = Llama(str(models / "ggml-vocab-qwen2.gguf"), vocab_only=True, verbose=False)
    tools_template, tokenizer.chat_template = tokenizer.chat_template, \
        gguf.metadata["tokenizer.chat_template"]
    try:
        plain = HFTokenizer(tokenizer, (tokenizer.eos_token_id,))
        with pytest.raises(InputError, match="does not take tools"):
            plain.apply_chat_template(ASK, [WEATHER])
        assert plain.apply_chat_template(ASK) == rendered(tokenizer, ASK, [])
    finally:
        tokenizer.chat_template = tools_template


def test_gguf_and_transformers_templates_render_tools_alike(models: Path,
                                                            tokenizer: Any) -> None:
    from llama_cpp import Llama

    from spececd.backends.llamacpp import LlamaCppTokenizer

    gguf = Llama(str(models / "ggml-vocab-qwen2.gguf"), vocab_only=True, verbose=False)
    theirs = LlamaCppTokenizer(gguf)
    with pytest.raises(InputError, match="does not take tools"):
        theirs.apply_chat_template(ASK, [WEATHER])
    # The same vocabulary with Qwen2.5's template, as a Qwen2.5 GGUF carries it.
    gguf.metadata["tokenizer.chat_template"] = tokenizer.chat_template
    conversation = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    ours = LlamaCppTokenizer(gguf).apply_chat_template(conversation, [WEATHER])
    # The same text (the ids differ where <tool_call> is one added token to transformers
    # and pieces to the GGUF, which lacks Qwen2.5's added tokens).
    assert ours is not None and "<tool_response>\n21\n</tool_response>" in theirs.decode(ours)
    assert theirs.decode(ours) == tokenizer.decode(rendered(tokenizer, conversation,
                                                            [WEATHER]))


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_deltas_hold_back_a_tag_and_send_calls_whole(gen: Generator,
                                                              parallel: bool) -> None:
    """The events of a stream whose text (as the generator yields it, split anywhere)
    is content, then two calls: content as soon as it is certain, each call as its id
    and name, then its arguments, the finish reason ``tool_calls`` on the last event;
    without parallel_tool_calls, the first call only."""
    body = ChatRequest(model="qwen", messages=ASK, tools=[WEATHER, TIME], stream=True,
                       parallel_tool_calls=parallel)
    api = Api(gen, "qwen", tool_parser="hermes")
    try:
        run = api.start(body, [[1, 2, 3]], 8, "chatcmpl", plan(body, "hermes"))
    finally:
        api.executor.shutdown(wait=True)
    texts = ["Let me check.\n<tool", '_call>\n{"name": "get_weather", "argu',
             'ments": {"city": "Lima", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n',
             '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', ""]
    chunks = [(run.choices[0], StreamChunk((7,), text, "target", "stop" if i == 4 else None))
              for i, text in enumerate(texts)]

    async def rest() -> AsyncIterator[tuple[Any, StreamChunk]]:
        for chunk in chunks[1:]:
            yield chunk

    async def collect() -> list[str]:
        return [event async for event in api.events(run, True, chunks[0], rest())]

    events = [json.loads(line[len("data: "):]) for event in asyncio.run(collect())
              for line in event.split("\n\n") if line.startswith("data: {")]
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events]
    assert [d for d, _ in deltas][:2] == [{"role": "assistant", "content": "Let me check.\n"},
                                          {}]  # "<tool" held back: it may open a call
    calls = [d["tool_calls"][0] for d, _ in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == ([0, 0, 1, 1] if parallel else [0, 0])
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {
        "name": "get_weather", "arguments": ""} and "id" not in calls[1]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Lima", "unit": "celsius"}
    assert not parallel or calls[2]["function"]["name"] == "get_time"
    assert [f for _, f in deltas] == [None] * (len(deltas) - 1) + ["tool_calls"]
    assert "".join(d.get("content") or "" for d, _ in deltas) == "Let me check.\n"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_llama3_json_round_trip(models: Path, tmp_path: Path, stream: bool) -> None:
    """The same round trip on Llama 3's vocabulary and Llama 3.1's template (tools in the
    first user message, calls as bare JSON with "parameters", results as ipython turns),
    served with the llama3_json parser."""
    tokenizer = llama31_tokenizer(models)
    target = build_model("llama", tmp_path / "target", tokenizer, seed=40, context=1024)
    draft = build_model("llama", tmp_path / "draft", tokenizer, seed=41, layers=1, hidden=32,
                        context=1024)
    with Generator.load(str(draft), str(target), device="cpu", dtype="float32",
                        threads=1) as llama:
        client = client_for(llama, "llama3_json")
        assert Api(llama, "qwen").tool_parser == "llama3_json"  # read from the template
        forced = {"type": "function", "function": {"name": "get_weather"}}
        request: dict[str, Any] = dict(model="qwen", messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice=forced, temperature=0, max_tokens=60)
        if stream:
            content, calls, finish = streamed_reply(client, **request)
        else:
            reply = client.chat.completions.create(**request)
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
            content = message.content or ""
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in message.tool_calls or ()]
        assert finish == "tool_calls" and content == "" and len(calls) == 1
        args = check_weather_call(calls[0]["name"], calls[0]["arguments"])
        said = {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]}
        result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "21"}
        final = client.chat.completions.create(model="qwen", messages=[*ASK, said, result],
                                               tools=[WEATHER, TIME], temperature=0,
                                               max_tokens=8)
        template_view = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]}, result]
        assert final.usage.prompt_tokens == len(rendered(tokenizer, template_view,
                                                         [WEATHER, TIME]))
        APIS.pop().executor.shutdown(wait=True)  # this test's own
