"""The sampling parameters users bring (repetition, presence and frequency penalties,
min-p, logit bias), through the whole pipeline: drafter, wire and verifier apply them
identically, so exact and match verification keep the target's own distribution
(chi-square, each parameter alone and all combined, in-process and over WebSocket), and
greedy output with a repetition penalty is transformers' own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spececd.core.params import SamplingParams  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from tests.chisq import PAIR_DRAWS, chi_square_p  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tests.reference import PROMPTS, exact_pair_distribution  # noqa: E402

# Strong values, so that each visibly changes the distribution of two tokens.
SETTINGS: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.8},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 2.0},
    "min_p": {"min_p": 0.4},
    "logit_bias": {"logit_bias": {2: 2.0, 5: -3.0}},
    "combined": {"repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.5,
                 "min_p": 0.2, "logit_bias": {3: 1.5}, "top_p": 0.7},
}


@pytest.fixture(scope="module")
def vocab_server(shared_server: Callable[[Path], ServerProcess],
                 tiny_vocab_pair: dict[str, Path]) -> ServerProcess:
    return shared_server(tiny_vocab_pair["target"])


@pytest.mark.parametrize("mode", ["exact", "match"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_parameter_keeps_the_target_distribution_in_process(
        setting: str, mode: str, tiny_vocab_pair: dict[str, Path]) -> None:
    with Generator.load(str(tiny_vocab_pair["draft"]), str(tiny_vocab_pair["target"]),
                        device="cpu", dtype="float32", k=3, mode=mode) as gen:
        assert_distribution(gen, tiny_vocab_pair["target"], SETTINGS[setting])


def test_combined_parameters_over_the_network(vocab_server: ServerProcess,
                                              tiny_vocab_pair: dict[str, Path]) -> None:
    with Generator.load(str(tiny_vocab_pair["draft"]), server=vocab_server.url,
                        device="cpu", dtype="float32", k=3, proactive="on") as gen:
        assert_distribution(gen, tiny_vocab_pair["target"], SETTINGS["combined"])


def assert_distribution(gen: Generator, target: Path, setting: dict[str, Any],
                        dtype: str = "float32") -> None:
    draws, prompt, vocab = PAIR_DRAWS, [1, 2, 2, 3], 10
    completions = gen.generate_n(prompt, draws, max_tokens=2, temperature=1.0, seed=4321,
                                 stop_token_ids=[], **setting)
    pairs = [c.token_ids for c in completions]
    assert all(len(p) == 2 for p in pairs)
    observed = np.bincount([a * vocab + b for a, b in pairs], minlength=vocab * vocab)
    params = gen.params(temperature=1.0, **setting)
    expected = exact_pair_distribution(target, prompt, params, dtype) * draws
    plain = exact_pair_distribution(target, prompt, SamplingParams(temperature=1.0,
                                                                   top_p=params.top_p), dtype)
    assert np.abs(expected / draws - plain).sum() > 0.1  # the setting changes the target
    for name in setting:  # and so does each of its parameters, left out one at a time
        rest = {k: v for k, v in setting.items() if k != name}
        without = exact_pair_distribution(target, prompt, gen.params(temperature=1.0, **rest),
                                          dtype)
        assert np.abs(expected / draws - without).sum() > 0.05, f"{name} changes nothing"
    p_value = chi_square_p(observed, expected)
    accepted = sum(c.stats.accepted for c in completions)
    drafted = sum(c.stats.drafted for c in completions)
    print(f"{setting}: p = {p_value:.3f}, acceptance {accepted / max(drafted, 1):.3f}")
    assert p_value > 0.001


def test_greedy_with_a_repetition_penalty_is_transformers_own(
        tiny_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"],
                                                 dtype=torch.float32).eval()
    with Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu",
                        dtype="float32", k=4) as gen:
        for prompt in PROMPTS[:3]:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[],
                               repetition_penalty=1.3)
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False,
                                    repetition_penalty=1.3, eos_token_id=None,
                                    pad_token_id=0)[0, len(ids):].tolist()
            plain = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
            assert out.token_ids == theirs
            assert out.token_ids != plain.token_ids  # the penalty changed the output
