"""Log-probabilities from logits, against hand-made cases: the chosen token's entry, the
alternatives' order (ties: the lower id first) and count, and which distribution each
``logprobs_mode`` reports."""

from __future__ import annotations

import numpy as np
import pytest

from spececd.core.logprobs import distribution_logprobs, log_softmax, token_logprobs
from spececd.core.params import PROCESSED, RAW, SamplingParams
from spececd.errors import InputError


def test_top_alternatives_are_ordered_and_ties_go_to_the_lower_id() -> None:
    logits = np.array([[0.0, 2.0, 1.0, 2.0, -1.0, 1.0],
                       [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]], np.float32)
    values = log_softmax(logits)
    out = token_logprobs(values, [4, 2], top=3)
    assert out.top_ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert out.chosen == pytest.approx([values[0, 4], values[1, 2]])
    assert out.top_logprobs[0] == pytest.approx(values[0, [1, 3, 2]])
    assert token_logprobs(values, [0, 0], top=10).top == 6  # at most the vocabulary
    assert token_logprobs(values, [0, 0], top=0).top_ids.shape == (2, 0)
    entries = out.entries([4, 2])
    assert entries[0].token_id == 4 and entries[0].top[0] == (1, pytest.approx(values[0, 1]))


def test_raw_ignores_sampling_and_processed_is_what_is_sampled_from() -> None:
    logits = np.array([[1.0, 3.0, 0.5, 2.0]])
    params = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0, prompt_len=1)
    history = [1]  # token 1 was seen: its logit 3 becomes 1.5
    assert distribution_logprobs(logits, RAW, params, history, 1) == pytest.approx(
        log_softmax(logits))
    processed = distribution_logprobs(logits, PROCESSED, params, history, 1)[0]
    kept = np.array([1.5, 2.0]) / 0.5  # tokens 1 and 3, the top 2 after the penalty
    expected = kept - np.log(np.exp(kept).sum())
    assert processed[[1, 3]] == pytest.approx(expected)
    assert np.isneginf(processed[[0, 2]]).all()
    # Greedy: the penalized logits' log_softmax, no temperature (as vLLM).
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0, prompt_len=1)
    assert distribution_logprobs(logits, PROCESSED, greedy, history, 1)[0] == pytest.approx(
        log_softmax(np.array([[1.0, 1.5, 0.5, 2.0]]))[0])


def test_requests_out_of_range_are_refused() -> None:
    with pytest.raises(InputError, match="0 to 20"):
        SamplingParams(logprobs=21)
    with pytest.raises(InputError, match="raw_logits"):
        SamplingParams(logprobs=1, logprobs_mode="raw_logits")
