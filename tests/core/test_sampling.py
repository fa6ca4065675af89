"""Logits processing against transformers' own logits warpers, and the samplers."""

from __future__ import annotations

import numpy as np
import pytest

from spececd.core.params import SamplingParams
from spececd.core.sampling import (
    SparseProbs,
    draft_distribution,
    process_logits,
    round_rng,
    sample,
    sample_sparse,
)
from spececd.errors import InputError

torch = pytest.importorskip("torch")


def hf_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    scores = warpers(None, torch.tensor(logits, dtype=torch.float64))
    return torch.softmax(scores, dim=-1).numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9),
    (0.8, 10, 0.7), (1.3, 1, 1.0), (1.0, 0, 0.05),
])
def test_process_logits_matches_transformers(temperature: float, top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)) * 3
    logits[0, :5] = 2.0  # ties at the top-k boundary are kept, as transformers does
    ours = process_logits(logits, SamplingParams(temperature=temperature, top_k=top_k,
                                                 top_p=top_p))
    np.testing.assert_allclose(ours, hf_probs(logits, temperature, top_k, top_p), atol=1e-12)


def test_temperature_zero_is_one_hot_argmax() -> None:
    logits = np.array([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    probs = process_logits(logits, SamplingParams(temperature=0))
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top-p"), (dict(top_p=1.01), "top-p"), (dict(top_k=-1), "top-k"),
    (dict(max_tokens=0), "max-tokens"),
])
def test_bad_params_are_input_errors(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InputError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sample_never_draws_zero_mass_and_follows_probs() -> None:
    probs = np.array([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    rng = np.random.default_rng(1)
    draws = np.bincount([sample(probs, rng) for _ in range(20000)], minlength=6)
    assert draws[[0, 2, 5]].sum() == 0
    np.testing.assert_allclose(draws / draws.sum(), probs, atol=0.015)


def test_round_rng_depends_only_on_seed_stream_position() -> None:
    a = round_rng(7, 0, 12).random(3)
    np.testing.assert_array_equal(a, round_rng(7, 0, 12).random(3))
    assert not np.array_equal(a, round_rng(7, 1, 12).random(3))
    assert not np.array_equal(a, round_rng(8, 0, 12).random(3))


def test_sparse_support_is_cut_and_renormalised() -> None:
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    dist = draft_distribution(logits, SamplingParams(temperature=1.0), max_support=2, history=())
    assert sorted(dist.ids.tolist()) == [0, 1]
    np.testing.assert_allclose(dist.dense(4), [4 / 7, 3 / 7, 0, 0], rtol=1e-6)
    assert abs(float(dist.probs.sum()) - 1) < 1e-6
    rng = np.random.default_rng(2)
    assert {sample_sparse(dist, rng) for _ in range(200)} == {0, 1}


def test_sparse_keeps_the_full_support_of_a_truncated_distribution() -> None:
    probs = np.array([0.0, 0.7, 0.0, 0.3])
    dist = SparseProbs.from_dense(probs)
    assert dist.ids.tolist() == [1, 3]
    assert dist.prob_of(3) == pytest.approx(0.3) and dist.prob_of(0) == 0.0
