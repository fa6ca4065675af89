"""Every option decided once: the same request, made through each entry point (command-line
flags, ``config.toml``, the Python API's keywords, an OpenAI request body), reaches the
edge as one resolved value (:class:`~spececd.edge.options.Resolved`) and the wire as one
``Hello``.

Each entry point runs its own code to the edge: the command's ``main``, the API's
``generate``, the OpenAI app's route. The edge client records what it was given, and the
link records the greeting it is asked to send and stops there, so no model forward runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from spececd.cli import main
from spececd.core.params import Mode
from spececd.edge.client import EdgeClient
from spececd.edge.link import Link
from spececd.edge.options import Proactive, Resolved
from spececd.generator import Generator
from spececd.protocol import messages as m

PROMPT = "def parse(line):"
STOP_TOKEN = 5  # a stop token beyond the tokenizer's end-of-sequence ones
# One request per scenario, as each entry point spells it. ``None``: the entry point has
# no such setting (the CLI and config.toml take no stop token ids).
SCENARIOS: dict[str, dict[str, tuple[Any, Any, Any, Any]]] = {
    # name: (flag value, config.toml value, API keyword value, OpenAI field value)
    "sampled": {
        "mode": ("match", "match", "match", "match"),
        "temperature": ("0.7", 0.7, 0.7, 0.7),
        "top_k": ("20", 20, 20, 20),
        "top_p": ("0.9", 0.9, 0.9, 0.9),
        "seed": ("1234", 1234, 1234, 1234),  # config.toml has none: its command's flag
        "max_tokens": ("17", 17, 17, 17),
        "k": ("3", 3, 3, 3),
        "proactive": ("on", "on", "on", "on"),
        "logit_bias": ("7:-100,9:2.5", "7:-100,9:2.5", {7: -100, 9: 2.5},
                       {"7": -100, "9": 2.5}),
        "repetition_penalty": ("1.2", 1.2, 1.2, 1.2),
        "presence_penalty": ("0.5", 0.5, 0.5, 0.5),
        "frequency_penalty": ("0.25", 0.25, 0.25, 0.25),
        "min_p": ("0.05", 0.05, 0.05, 0.05),
    },
    # Greedy mode: temperature 0 whatever was asked; auto proactive and k, in-process.
    "greedy": {
        "mode": ("greedy", "greedy", "greedy", "greedy"),
        "temperature": ("0.7", 0.7, 0.7, 0.7),
        "seed": ("99", 99, 99, 99),
        "max_tokens": ("5", 5, 5, 5),
        "top_k": (None, None, None, -1),  # OpenAI's -1 (vLLM's "off") is the default, 0
    },
}
EXPECTED: dict[str, dict[str, Any]] = {
    "sampled": {"mode": Mode.MATCH, "temperature": 0.7, "top_k": 20, "top_p": 0.9,
                "seed": 1234, "max_tokens": 17, "k": 3, "proactive": Proactive.ON,
                "logit_bias": ((7, -100.0), (9, 2.5)), "repetition_penalty": 1.2,
                "presence_penalty": 0.5, "frequency_penalty": 0.25, "min_p": 0.05},
    "greedy": {"mode": Mode.GREEDY, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 99,
               "max_tokens": 5, "k": None, "proactive": Proactive.OFF, "logit_bias": (),
               "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
               "min_p": 0.0},
}
ENTRY_POINTS = ("cli", "config", "api", "openai")


class Greeted(Exception):
    """Raised by the link in place of sending the greeting: the test has what it needs."""


Seen = tuple[Resolved, m.Hello]  # what the edge client was given, what the link would send


@pytest.fixture(scope="module")
def pair(tiny_models: dict[str, Path]) -> tuple[str, str]:
    return str(tiny_models["draft"]), str(tiny_models["llama"])


@pytest.fixture(scope="module")
def eos(pair: tuple[str, str]) -> tuple[int, ...]:
    with Generator.load(pair[0], pair[1], device="cpu") as gen:
        return tuple(gen.tokenizer.eos_token_ids)


def record(patch: pytest.MonkeyPatch) -> list[Any]:
    """Make the edge client note what it is given (a Resolved) and the link note the first
    frame it is asked to send (the Hello), then stop; returns the notes, in order."""
    seen: list[Any] = []
    generate = EdgeClient.generate

    def recording_generate(self: EdgeClient, prompt_ids: Any, run: Resolved, *args: Any,
                           **kwargs: Any) -> Any:
        seen.append(run)
        return generate(self, prompt_ids, run, *args, **kwargs)

    def greet(self: Link, session: Any, stats: Any) -> m.Welcome:
        seen.append(m.decode(session.hello()))
        raise Greeted

    patch.setattr(EdgeClient, "generate", recording_generate)
    patch.setattr(Link, "greet", greet)
    return seen


def via_cli(values: dict[str, Any], pair: tuple[str, str], tmp_path: Path) -> None:
    argv = ["generate", "--draft-model", pair[0], "--target-model", pair[1], "--device", "cpu",
            "--prompt", PROMPT, "--json"]
    for name, value in values.items():
        argv += [f"--{name.replace('_', '-')}", value]
    with pytest.raises(Greeted):
        main(argv)


def via_config(values: dict[str, Any], pair: tuple[str, str], tmp_path: Path) -> None:
    settings = {"draft_model": pair[0], "target_model": pair[1], "device": "cpu",
                **{name: value for name, value in values.items() if name != "seed"}}
    path = tmp_path / "config.toml"
    path.write_text("[edge]\n" + "".join(f"{name} = {json.dumps(value)}\n"
                                         for name, value in settings.items()))
    with pytest.raises(Greeted):
        main(["generate", "--config", str(path), "--prompt", PROMPT, "--json",
              *(["--seed", str(values["seed"])] if "seed" in values else [])])


def via_api(values: dict[str, Any], pair: tuple[str, str], tmp_path: Path) -> None:
    edge = {name: values.pop(name) for name in ("mode", "k", "proactive") if name in values}
    with Generator.load(pair[0], pair[1], device="cpu", **edge) as gen:
        stops = (*gen.tokenizer.eos_token_ids, STOP_TOKEN)
        with pytest.raises(Greeted):
            gen.generate(PROMPT, stop_token_ids=stops, **values)


def via_openai(values: dict[str, Any], pair: tuple[str, str], tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from spececd.openai_api.server import Api, create_app

    with Generator.load(pair[0], pair[1], device="cpu") as gen:
        api = Api(gen, "spececd")
        try:
            with TestClient(create_app(api), raise_server_exceptions=False) as client:
                body = {"model": "spececd", "prompt": PROMPT, "stop_token_ids": [STOP_TOKEN],
                        **values}
                reply = client.post("/v1/completions", json=body)
        finally:
            api.executor.shutdown(wait=True)
    assert reply.status_code == 500 and "Greeted" in reply.text  # the link stopped it


ENTRY: dict[str, Callable[[dict[str, Any], tuple[str, str], Path], None]] = {
    "cli": via_cli, "config": via_config, "api": via_api, "openai": via_openai}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def reached(request: pytest.FixtureRequest, pair: tuple[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Seen]]:
    """A scenario, and what each entry point's request for it reached the edge as."""
    scenario = request.param
    results: dict[str, Seen] = {}
    with pytest.MonkeyPatch.context() as patch:
        seen = record(patch)
        for i, entry in enumerate(ENTRY_POINTS):
            values = {name: spelled[i] for name, spelled in SCENARIOS[scenario].items()
                      if spelled[i] is not None}
            ENTRY[entry](values, pair, tmp_path_factory.mktemp(entry))
            run, hello = seen  # one generation, one greeting
            assert isinstance(run, Resolved) and isinstance(hello, m.Hello), seen
            results[entry] = (run, hello)
            seen.clear()
    return scenario, results


NOT_SENT = object()  # the option is the edge's alone: the Hello does not carry it


def read(option: str, run: Resolved, hello: m.Hello) -> tuple[Any, Any]:
    """``option``'s resolved value, and its value in the Hello."""
    options, params, extras = run.options, run.params, hello.extras
    return {
        "mode": (options.mode, Mode(hello.mode)),
        "temperature": (params.temperature, hello.temperature),
        "top_k": (params.top_k, hello.top_k),
        "top_p": (params.top_p, hello.top_p),
        "seed": (params.seed, hello.seed),
        "max_tokens": (params.max_tokens, NOT_SENT),
        "k": (options.k, NOT_SENT),
        "proactive": (options.proactive, NOT_SENT),
        "stop_token_ids": (params.stop_token_ids, NOT_SENT),
        "logit_bias": (params.logit_bias, extras.logit_bias),
        "repetition_penalty": (params.repetition_penalty, extras.repetition_penalty),
        "presence_penalty": (params.presence_penalty, extras.presence_penalty),
        "frequency_penalty": (params.frequency_penalty, extras.frequency_penalty),
        "min_p": (params.min_p, extras.min_p),
    }[option]


@pytest.mark.parametrize("option", [*EXPECTED["sampled"], "stop_token_ids"])
def test_each_option_reaches_the_wire_as_one_value_from_every_entry_point(
        option: str, reached: tuple[str, dict[str, Seen]], eos: tuple[int, ...]) -> None:
    scenario, results = reached
    if option == "stop_token_ids":  # the flags and config.toml cannot add a stop token
        expected = {entry: (*eos, STOP_TOKEN) if entry in ("api", "openai") else eos
                    for entry in ENTRY_POINTS}
    else:
        expected = dict.fromkeys(ENTRY_POINTS, EXPECTED[scenario][option])
    got = {entry: read(option, *seen) for entry, seen in results.items()}
    assert {entry: value for entry, (value, _) in got.items()} == expected
    sent = {entry: wire for entry, (_, wire) in got.items() if wire is not NOT_SENT}
    assert sent == {entry: expected[entry] for entry in sent}


def test_the_prompts_length_reaches_the_wire_where_penalties_count_the_output(
        reached: tuple[str, dict[str, Seen]]) -> None:
    scenario, results = reached
    lengths = {entry: (run.params.prompt_len, hello.extras.prompt_len)
               for entry, (run, hello) in results.items()}
    prompt_len = lengths["api"][0]
    assert prompt_len > 0
    # Sent only when presence or frequency penalties count the output after the prompt.
    on_wire = prompt_len if scenario == "sampled" else 0
    assert lengths == dict.fromkeys(ENTRY_POINTS, (prompt_len, on_wire))
