"""Lossless in bfloat16, the dtype ``--dtype auto`` runs the default target in on a CPU with
AMX (and on a GPU): SpecECD's greedy output against the target alone in bfloat16
(transformers' ``generate``), and sampled output against the target's bfloat16 distribution.

In bfloat16 a pass over several positions and a step over one round differently (the
conformance tests measure at most 0.031 in logits between them), so where the target's two
most likely tokens are that close, SpecECD and ``generate`` may each take one. Every
divergence must be such a tie: the target's top-2 margin there, in a fresh bfloat16 pass,
within :data:`TIE`. A divergence with a wider margin is a bug (a token verified against
the wrong position's logits, a stale cache), and fails.

Runs on every CPU torch computes bfloat16 on (all of them; emulated where there is no
AVX512-BF16 or AMX, only slower), so CI checks it whatever machine it gets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spececd.generator import Generator  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.reference import hf_greedy, hf_logits  # noqa: E402

TIE = 0.125  # logits: four bfloat16 steps at the default target's scale, where a shape's
# rounding can flip the order; the conformance tests measured one
N = 48


@pytest.fixture(scope="module")
def bf16_gen() -> Generator:
    gen = Generator.load(str(MODELS / "draft"), str(MODELS / "target"), device="cpu",
                         dtype="bfloat16", k=4, proactive="off")
    assert gen.target_backend is not None
    assert gen.target_backend.model.dtype == torch.bfloat16  # type: ignore[attr-defined]
    return gen


def top2_margin(ids: list[int]) -> tuple[float, tuple[int, int]]:
    logits = hf_logits(MODELS / "target", ids, "bfloat16")
    first, second = np.argsort(-logits)[:2]
    return float(logits[first] - logits[second]), (int(first), int(second))


@requires_default_pair
def test_greedy_in_bfloat16_is_the_target_alones_up_to_ties(bf16_gen: Generator) -> None:
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())[:8]
    identical, ties = 0, []
    for prompt in prompts:
        ids = bf16_gen.prompt_ids(prompt)
        ours = bf16_gen.generate(ids, max_tokens=N, temperature=0, stop_token_ids=[]).token_ids
        alone = hf_greedy(MODELS / "target", ids, N, "bfloat16")
        at = next((i for i, (a, b) in enumerate(zip(ours, alone, strict=True)) if a != b), None)
        if at is None:
            identical += 1
            continue
        margin, top = top2_margin([*ids, *alone[:at]])
        ties.append((at, round(margin, 4)))
        assert {ours[at], alone[at]} <= set(top), (prompt[:40], at, top, ours[at], alone[at])
        assert margin <= TIE, f"a divergence at token {at} where the target's top two " \
                              f"are {margin:.3f} apart: no bfloat16 tie, a bug"
    print(f"bfloat16 greedy: {identical} of {len(prompts)} identical; ties at {ties}")
    assert identical >= len(prompts) // 2  # ties are rare: most prompts never meet one


@pytest.mark.parametrize("mode", ["exact", "match"])
def test_sampling_in_bfloat16_keeps_the_targets_bfloat16_distribution(
        mode: str, tiny_vocab_pair: dict[str, Path]) -> None:
    """Every sampling parameter at once, both sides in bfloat16: the first two tokens'
    distribution is the bfloat16 target's (chi-square over tests/chisq.py's PAIR_DRAWS)."""
    from tests.e2e.test_sampling_params import SETTINGS, assert_distribution

    with Generator.load(str(tiny_vocab_pair["draft"]), str(tiny_vocab_pair["target"]),
                        device="cpu", dtype="bfloat16", k=3, mode=mode) as gen:
        assert_distribution(gen, tiny_vocab_pair["target"], SETTINGS["combined"], "bfloat16")
