"""Three agent frameworks that no test here drives, against `spececd api` as the README
installs it: pydantic-ai, langchain-openai and openai-agents, each through its own client
code (no request written here), one line per call with its outcome: plain chat, streaming,
every structured-output mode, forced tool calls, and OpenAI's request fields that SpecECD
takes and ignores (``store``, ``service_tier``, ``reasoning_effort``, ...).

The frameworks pull their own versions of the openai client (and websockets), so they live
in a virtual environment of their own, a client's, apart from the server's::

    python -m venv /tmp/agents
    /tmp/agents/bin/pip install "pydantic-ai-slim[openai]" langchain-openai openai-agents
    /tmp/agents/bin/python scripts/agent-frameworks.py --spececd /path/to/venv/bin/spececd

It starts ``spececd api --port 0`` with the ``spececd`` given (the default pair in one
process) and ends it (and its process group) whatever happens; ``--base-url`` uses a
running server instead. Greedy (temperature 0), at most ``--max-tokens`` a reply. The
small default model never chooses a tool of its own under ``tool_choice: auto`` (a
limit of the model's, not the API's), so the tool calls here are forced; the schemas bound
their strings and numbers, so a valid object closes before the token limit. Exits 1 when a
call failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, Field

MODEL = "spececd"


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=20)


def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


ASK_PERSON = "Jason is 25 years old. Who is it?"
ASK_WEATHER = "What is the weather in Paris?"
ROWS: list[tuple[str, str, str, str, float]] = []  # framework, call, outcome, detail, s


def record(framework: str, call: str, run: Callable[[], str], prompted: bool = False) -> None:
    """Run one call and keep its outcome: ok and what it returned, or the failure.
    ``prompted``: the schema is in the prompt only (the server constrains the output to
    any JSON object, or not at all), so what the object holds is the model's reading of
    the prompt: a failure there is the model's (outcome ``model``), not the API's."""
    started = time.perf_counter()
    try:
        detail, outcome = run(), "ok"
    except Exception as exc:  # every failure is an outcome to report, not the script's end
        outcome = "model" if prompted else "FAILED"
        detail = f"{type(exc).__name__}: {exc}"
        if os.environ.get("AGENTS_TRACEBACK"):
            traceback.print_exc()
    seconds = time.perf_counter() - started
    detail = re.sub(r"\s+", " ", detail)[:150]
    ROWS.append((framework, call, outcome, detail, seconds))
    print(f"{framework:<16} {call:<44} {outcome:<6} {seconds:5.1f} s  {detail}", flush=True)


def pydantic_ai(base_url: str, max_tokens: int) -> None:
    from pydantic_ai import Agent, NativeOutput, PromptedOutput, ToolOutput
    from pydantic_ai.direct import model_request_sync
    from pydantic_ai.messages import ModelRequest, ToolCallPart
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIChatModelSettings
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="none"))
    settings = OpenAIChatModelSettings(temperature=0, max_tokens=max_tokens)
    name = "pydantic-ai"
    record(name, "plain chat", lambda: str(
        Agent(model, model_settings=settings).run_sync("Say hello.").output))

    def streamed() -> str:
        async def run() -> str:
            agent = Agent(model, model_settings=settings)
            async with agent.run_stream("Say hello.") as result:
                parts = [delta async for delta in result.stream_text(delta=True)]
            return f"{len(parts)} deltas: {''.join(parts)}"
        return asyncio.run(run())

    record(name, "streaming (run_stream)", streamed)
    for mode, output in (("ToolOutput (default, forced tool call)", ToolOutput(Person)),
                         ("NativeOutput (json_schema)", NativeOutput(Person)),
                         ("PromptedOutput (schema in the prompt)", PromptedOutput(Person))):
        record(name, f"output {mode}", lambda output=output: repr(
            Agent(model, output_type=output, model_settings=settings).run_sync(
                ASK_PERSON).output), prompted=isinstance(output, PromptedOutput))

    def forced_call() -> str:
        tool = ToolDefinition(name="get_weather", description="The weather in a city.",
                              parameters_json_schema=Weather.model_json_schema())
        response = model_request_sync(model, [ModelRequest.user_text_prompt(ASK_WEATHER)],
                                      model_settings=settings,
                                      model_request_parameters=ModelRequestParameters(
                                          function_tools=[tool], allow_text_output=False))
        calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
        assert calls, f"no tool call: {response.parts}"
        return "; ".join(f"{c.tool_name}({c.args_as_json_str()})" for c in calls)

    record(name, "forced tool call (direct, required)", forced_call)
    fields = OpenAIChatModelSettings(
        temperature=0, max_tokens=max_tokens, openai_store=False, openai_user="user-1",
        openai_service_tier="flex", openai_reasoning_effort="low",
        openai_prompt_cache_key="k", openai_text_verbosity="low")
    record(name, "store, user, service_tier, reasoning_effort, prompt_cache_key, verbosity",
           lambda: str(Agent(model, model_settings=fields).run_sync("Say hello.").output))


def langchain(base_url: str, max_tokens: int) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="none", model=MODEL,
                     temperature=0, max_tokens=max_tokens, max_retries=0)
    name = "langchain-openai"
    record(name, "plain chat (invoke)", lambda: str(llm.invoke("Say hello.").content))
    record(name, "streaming (stream)", lambda: "".join(
        str(chunk.content) for chunk in llm.stream("Say hello.")))
    for method in ("json_schema", "function_calling", "json_mode"):
        record(name, f"with_structured_output {method}", lambda method=method: repr(
            llm.with_structured_output(Person, method=method).invoke(ASK_PERSON)),
            prompted=method == "json_mode")
    for choice in ("get_weather", "required", "any"):
        def bound(choice: str = choice) -> str:
            reply = llm.bind_tools([Weather.model_json_schema() | {"title": "get_weather"}],
                                   tool_choice=choice).invoke(ASK_WEATHER)
            assert reply.tool_calls, f"no tool call: {reply}"
            return "; ".join(f"{c['name']}({c['args']})" for c in reply.tool_calls)
        record(name, f"bind_tools tool_choice={choice}", bound)
    fields = ChatOpenAI(base_url=base_url, api_key="none", model=MODEL,
                        temperature=0, max_tokens=max_tokens, max_retries=0,
                        service_tier="flex", reasoning_effort="low", store=False,
                        stream_usage=True, extra_body={"metadata": {"run": "7"}})
    record(name, "service_tier, reasoning_effort, store, metadata, stream usage",
           lambda: "".join(str(chunk.content) for chunk in fields.stream("Say hello.")))


def openai_agents(base_url: str, max_tokens: int) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)  # no traces sent to OpenAI
    name = "openai-agents"

    def model() -> Any:  # a client per run: each run_sync has an event loop of its own
        return OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(
            base_url=base_url, api_key="none", max_retries=0))

    settings = ModelSettings(temperature=0, max_tokens=max_tokens)
    record(name, "plain chat (Runner.run_sync)", lambda: str(Runner.run_sync(
        Agent(name="a", model=model(), model_settings=settings), "Say hello.").final_output))

    def streamed() -> str:
        async def run() -> str:
            result = Runner.run_streamed(
                Agent(name="a", model=model(), model_settings=settings), "Say hello.")
            events = [event async for event in result.stream_events()]
            return f"{len(events)} events: {result.final_output}"
        return asyncio.run(run())

    record(name, "streaming (run_streamed)", streamed)
    record(name, "output_type (json_schema)", lambda: repr(Runner.run_sync(
        Agent(name="a", model=model(), model_settings=settings, output_type=Person),
        ASK_PERSON).final_output))
    weather = function_tool(get_weather)
    for choice in ("required", "get_weather"):
        def forced(choice: str = choice) -> str:
            agent = Agent(name="a", model=model(), tools=[weather],
                          model_settings=ModelSettings(temperature=0, max_tokens=max_tokens,
                                                       tool_choice=choice),
                          tool_use_behavior="stop_on_first_tool")
            result = Runner.run_sync(agent, ASK_WEATHER)
            return f"{result.final_output} (the tool's result)"
        record(name, f"tool_choice={choice}", forced)
    fields = ModelSettings(temperature=0, max_tokens=max_tokens, store=False,
                           metadata={"run": "7"}, reasoning=Reasoning(effort="low"),
                           verbosity="low", include_usage=True)
    record(name, "store, metadata, reasoning_effort, verbosity, usage", lambda: str(
        Runner.run_sync(Agent(name="a", model=model(), model_settings=fields),
                        "Say hello.").final_output))


def start_api(spececd: str, timeout: float = 300) -> tuple[subprocess.Popen[str], str]:
    """``spececd api --port 0`` in a process group of its own, and its base URL."""
    proc = subprocess.Popen([spececd, "api", "--port", "0"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("spececd: serving"):
                found.append(line)
                print(line.rstrip(), flush=True)
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout)
    if not found:
        stop(proc)
        raise SystemExit(f"`{spececd} api` did not start within {timeout} s")
    url = re.search(r"(http://\S+/v1)", found[0])
    assert url is not None
    return proc, url[1]


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spececd", default="spececd", help="the spececd command to start "
                        "`spececd api` with (default: the one on PATH)")
    parser.add_argument("--base-url", help="a running `spececd api`'s /v1 URL instead")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    proc = None
    try:
        if args.base_url:
            base_url = args.base_url
        else:
            proc, base_url = start_api(args.spececd)
        for framework in (pydantic_ai, langchain, openai_agents):
            try:
                framework(base_url, args.max_tokens)
            except ImportError as exc:
                print(f"{framework.__name__}: not installed ({exc}): skipped", flush=True)
    finally:
        if proc is not None:
            stop(proc)
    failed = [row for row in ROWS if row[2] == "FAILED"]
    model = sum(row[2] == "model" for row in ROWS)
    print(f"\n{len(ROWS) - len(failed) - model} of {len(ROWS)} calls ok, {len(failed)} "
          f"failed, {model} where the model did not read a schema given in the prompt only")
    print("\n| framework | call | outcome | seconds | returned |\n| --- | --- | --- | --- | --- |")
    for framework, call, outcome, detail, seconds in ROWS:
        print(f"| {framework} | {call} | {outcome} | {seconds:.1f} | "
              f"{detail.replace('|', '/')} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
