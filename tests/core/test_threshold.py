"""Threshold verification, the one LOSSY mode: kept out of every lossless test and tested
for what it does promise. Its output is not the target's distribution, so nothing here
compares it with the target; acceptance must rise as the threshold falls, the first
rejection must be the target's own draw, and a threshold outside (0, 1] is refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from spececd.core.params import Mode, SamplingParams
from spececd.core.sampling import process_logits, sample
from spececd.core.stats import GenerationStats
from spececd.core.verify import VerifyResult, verify

V, K, DRAWS = 32, 4, 4000
_tables = np.random.default_rng(42)
_target_logits = _tables.normal(size=(V, V)) * 2.5  # row: previous token
TARGET = process_logits(_target_logits, SamplingParams(temperature=1.0))
DRAFT = process_logits(_target_logits + _tables.normal(size=(V, V)),
                       SamplingParams(temperature=1.0))


def test_mode_is_labelled_lossy() -> None:
    assert Mode.THRESHOLD.lossy
    assert not any(mode.lossy for mode in (Mode.EXACT, Mode.MATCH, Mode.GREEDY))


def test_statistics_carry_the_label_through_a_merge() -> None:
    total = GenerationStats()
    total.merge(GenerationStats(lossy=True))
    total.merge(GenerationStats())
    assert total.lossy and total.as_dict()["lossy"] is True
    assert GenerationStats().as_dict()["lossy"] is False


def test_keeps_drafts_at_or_above_the_threshold_and_replaces_the_first_below() -> None:
    target = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [1.0, 0.0, 0.0]])
    rng = np.random.default_rng(0)
    assert verify([1, 1, 2], target, rng, Mode.THRESHOLD, threshold=0.3) == VerifyResult(3, 0)
    rejected = [verify([2, 1, 2], target, rng, Mode.THRESHOLD, threshold=0.3)
                for _ in range(3000)]
    assert {r.num_accepted for r in rejected} == {0}
    # The replacement is the target's own draw at that position, the rejected token included.
    counts = np.bincount([r.next_token for r in rejected], minlength=3) / len(rejected)
    np.testing.assert_allclose(counts, target[0], atol=0.03)


@pytest.mark.parametrize("threshold", [0.0, -0.5, 1.01, float("nan")])
def test_a_threshold_outside_0_1_is_refused(threshold: float) -> None:
    with pytest.raises(ValueError, match="threshold"):
        verify([1], np.full((2, 3), 1 / 3), np.random.default_rng(0), Mode.THRESHOLD,
               threshold=threshold)


def acceptance(threshold: float, seed: int = 0) -> float:
    """Acceptance rate of DRAWS rounds of K tokens drafted by the toy Markov draft model."""
    rng = np.random.default_rng(seed)
    stats = GenerationStats()
    for _ in range(DRAWS):
        previous, drafted = int(rng.integers(V)), []
        for _ in range(K):
            drafted.append(sample(DRAFT[drafted[-1] if drafted else previous], rng))
        rows = [previous, *drafted]
        result = verify(drafted, TARGET[rows], rng, Mode.THRESHOLD, threshold=threshold)
        stats.record_round(K, result.num_accepted)
    return stats.acceptance_rate


def test_acceptance_rises_as_the_threshold_falls() -> None:
    thresholds = [0.8, 0.5, 0.3, 0.15, 0.05, 0.01]
    rates = [acceptance(t) for t in thresholds]
    print("threshold -> acceptance:", dict(zip(thresholds, np.round(rates, 4), strict=True)))
    # Each step changes acceptance by far more than its sampling error (SE <= 0.004 here).
    assert all(later > earlier + 0.02 for earlier, later in itertools.pairwise(rates))
