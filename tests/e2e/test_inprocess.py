"""In-process generation end to end: greedy output identical to the target alone, exact
stopping, streaming, seeds. Runs through the same frames and session state machines as
the networked path (the in-memory transport)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from spececd.generator import Generator  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.reference import PROMPTS, hf_greedy  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gen(tiny_models: dict[str, Path]) -> Generator:
    return Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu",
                          dtype="float32", k=4)


@pytest.mark.parametrize("mode,k", [("exact", 4), ("match", 4), ("greedy", 4), ("exact", None)])
def test_greedy_is_identical_to_the_target_alone(mode: str, k: int | None,
                                                 tiny_models: dict[str, Path],
                                                 tiny_gen: Generator) -> None:
    before = tiny_gen.options
    tiny_gen.options = before.with_settings(mode=mode, k=k or "auto")
    for prompt in PROMPTS:
        ids = tiny_gen.prompt_ids(prompt)
        ours = tiny_gen.generate(ids, max_tokens=40, temperature=0, stop_token_ids=[])
        assert ours.token_ids == hf_greedy(tiny_models["llama"], ids, 40)
    tiny_gen.options = before


def test_draft_of_the_target_itself_accepts_everything(tiny_models: dict[str, Path]) -> None:
    gen = Generator.load(str(tiny_models["llama"]), str(tiny_models["llama"]), device="cpu",
                         dtype="float32", k=4)
    out = gen.generate("def f(x):", max_tokens=21, temperature=0, stop_token_ids=[])
    assert out.stats.acceptance_rate == 1.0
    # Four rounds of 4 accepted + 1 bonus, then one round drafting nothing for the last token.
    assert (out.stats.rounds, out.stats.drafted, out.stats.accepted) == (5, 16, 16)
    assert out.stats.mean_accepted_len == pytest.approx((16 + 5) / 5)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9, 17])
def test_max_tokens_is_exact(max_tokens: int, tiny_gen: Generator) -> None:
    for temperature in (0.0, 1.0):
        out = tiny_gen.generate("x = ", max_tokens=max_tokens, temperature=temperature, seed=1,
                                stop_token_ids=[])
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length"


def test_stop_token_ends_generation_exactly(tiny_models: dict[str, Path],
                                            tiny_gen: Generator) -> None:
    ids = tiny_gen.prompt_ids(PROMPTS[0])
    reference = hf_greedy(tiny_models["llama"], ids, 40)
    for position in (0, 3, 10):
        stop = reference[position]
        first = reference.index(stop)
        out = tiny_gen.generate(ids, max_tokens=40, temperature=0, stop_token_ids=[stop])
        assert out.token_ids == reference[:first + 1]
        assert out.finish_reason == "stop"


def test_stream_equals_generate_and_marks_sources(tiny_gen: Generator) -> None:
    chunks = list(tiny_gen.stream(PROMPTS[1], max_tokens=30, temperature=0.8, seed=11))
    whole = tiny_gen.generate(PROMPTS[1], max_tokens=30, temperature=0.8, seed=11)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert {c.source for c in chunks} <= {"draft", "target"}
    assert sum(len(c.token_ids) for c in chunks if c.source == "target") == whole.stats.own


def test_sampled_stream_drafting_in_process_is_the_targets_own_output(
        tiny_models: dict[str, Path]) -> None:
    # (greedy identity over every transport: tests/e2e/test_transports.py)
    gen = Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu",
                         dtype="float32", k=4, proactive="stream")
    ids = gen.prompt_ids(PROMPTS[1])
    sampled = gen.generate(ids, max_tokens=30, temperature=1.0, seed=4, stop_token_ids=[])
    alone = gen.generate(ids, cloud_only=True, max_tokens=30, temperature=1.0, seed=4,
                         stop_token_ids=[])
    assert sampled.token_ids == alone.token_ids
    gen.close()


def test_seed_makes_sampling_reproducible(tiny_gen: Generator) -> None:
    a = tiny_gen.generate_n(PROMPTS[2], 3, max_tokens=20, temperature=1.0, seed=5)
    b = tiny_gen.generate_n(PROMPTS[2], 3, max_tokens=20, temperature=1.0, seed=5)
    c = tiny_gen.generate(PROMPTS[2], max_tokens=20, temperature=1.0, seed=6)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert a[1].token_ids == c.token_ids  # completion i uses seed + i
    assert len({tuple(x.token_ids) for x in a}) > 1


@requires_default_pair
def test_default_pair_greedy_identical_on_20_heldout_prompts() -> None:
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())
    assert len(prompts) == 20
    gen = Generator.load(str(MODELS / "draft"), str(MODELS / "target"), device="cpu",
                         dtype="float32", k=4)
    accepted = drafted = 0
    for prompt in prompts:
        ids = gen.prompt_ids(prompt)
        ours = gen.generate(ids, max_tokens=48, temperature=0, stop_token_ids=[])
        assert ours.token_ids == hf_greedy(MODELS / "target", ids, 48), prompt
        accepted, drafted = accepted + ours.stats.accepted, drafted + ours.stats.drafted
    assert accepted / drafted > 0.3  # the trained pair really agrees


@requires_default_pair
def test_threshold_mode_is_labelled_lossy_and_keeps_more_as_the_threshold_falls() -> None:
    """Threshold mode promises no distribution, only this: it says it is lossy, and a lower
    threshold keeps more of the drafted tokens."""
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())[:4]
    rates = []
    for threshold in (0.6, 0.1, 0.01):
        with Generator.load(str(MODELS / "draft"), str(MODELS / "target"), device="cpu",
                            dtype="float32", k=4, mode="threshold",
                            threshold=threshold) as gen:
            accepted = drafted = 0
            for prompt in prompts:
                out = gen.generate(prompt, max_tokens=40, temperature=1.0, seed=1,
                                   stop_token_ids=[])
                assert out.stats.lossy and out.stats.as_dict()["lossy"] is True
                accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
        rates.append(accepted / drafted)
    print(f"threshold acceptance: {rates}")
    assert rates[0] < rates[1] < rates[2]
    with Generator.load(str(MODELS / "draft"), str(MODELS / "target"), device="cpu",
                        dtype="float32", k=4) as gen:
        assert not gen.generate(prompts[0], max_tokens=8, seed=1).stats.lossy


def test_stop_strings_are_found_across_pieces_and_held_back_meanwhile() -> None:
    from spececd.text import StopStrings

    stops = StopStrings(["END", "\n\n"])
    assert stops.push("abc E") == "abc "  # "E" may begin "END": held back
    assert stops.push("N") == ""
    assert stops.push("x") == "ENx"  # it did not
    assert stops.push("y\n") == "y"
    assert stops.push("\nmore") == "" and stops.found  # "\n\n" across two pieces
    assert stops.push("later") == ""
    overlapping = StopStrings(["aab"])
    assert overlapping.push("aaa") == "a" and overlapping.push("b") == "" and overlapping.found


def test_the_completion_ends_cleanly_at_a_stop(tiny_gen: Generator) -> None:
    ids = tiny_gen.prompt_ids(PROMPTS[0])
    full = tiny_gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
    # A stop token: kept in the ids, its text left out of the completion.
    stop_id = full.token_ids[6]
    at_token = tiny_gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[stop_id])
    assert at_token.token_ids == full.token_ids[:7] and at_token.finish_reason == "stop"
    assert at_token.text == tiny_gen.tokenizer.decode(full.token_ids[:6])
    # A stop string: the ids are the ones that spelled it, and no more.
    text = full.text
    stop = text[len(tiny_gen.tokenizer.decode(full.token_ids[:10])):][:3]
    cut = tiny_gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[], stop=[stop])
    assert cut.text == text[:text.find(stop)] and cut.finish_reason == "stop"
    assert stop in tiny_gen.tokenizer.decode(cut.token_ids)
    assert stop not in tiny_gen.tokenizer.decode(cut.token_ids[:-1])
    assert cut.stats.generated >= len(cut.token_ids)


def test_per_call_options_and_threshold_with_cloud_only(tiny_gen: Generator) -> None:
    ids = tiny_gen.prompt_ids(PROMPTS[1])
    greedy = tiny_gen.generate(ids, max_tokens=16, temperature=0, stop_token_ids=[])
    forced = tiny_gen.generate(ids, max_tokens=16, temperature=1.0, seed=3, stop_token_ids=[],
                               options=tiny_gen.options.with_settings(mode="greedy"))
    assert forced.token_ids == greedy.token_ids  # greedy mode means temperature 0
    lossy = tiny_gen.options.with_settings(mode="threshold", threshold=0.2)
    out = tiny_gen.generate(ids, max_tokens=8, seed=3, cloud_only=True, options=lossy)
    assert len(out.token_ids) == 8  # cloud-only verifies nothing: no threshold is sent
    assert lossy.with_settings(mode="exact").threshold == 0.0


def test_a_prompt_that_is_no_unicode_text_is_an_input_error(tiny_gen: Generator) -> None:
    """A lone surrogate (a str Python holds but UTF-8 cannot encode): the caller's error,
    named, not the tokenizer's TypeError."""
    from spececd.errors import InputError

    with pytest.raises(InputError, match="surrogate at character 4"):
        tiny_gen.generate("def \ud800", max_tokens=2)
