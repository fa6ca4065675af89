"""The sampling parameters that depend on the tokens so far, and min-p, against
transformers' own logits processors (or OpenAI's definition, where transformers has none)
to 1e-6; and a block's rows, each following the drafted tokens before it, equal to
processing each prefix alone."""

from __future__ import annotations

import numpy as np
import pytest

from spececd.core.params import SamplingParams
from spececd.core.sampling import penalize, process_logits

torch = pytest.importorskip("torch")
generation = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 50
RNG = np.random.default_rng(0)
LOGITS = RNG.normal(0, 3, size=(1, VOCAB)).astype(np.float32)
HISTORY = [int(t) for t in RNG.integers(0, VOCAB, size=30)]
PROMPT_LEN = 12


def transformers(processors: list[object], history: list[int], logits: np.ndarray
                 ) -> np.ndarray:
    scores = torch.tensor(logits, dtype=torch.float64)
    ids = torch.tensor([history])
    for processor in processors:
        scores = processor(ids, scores)  # type: ignore[operator]
    return scores.numpy()  # type: ignore[no-any-return]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers(penalty: float) -> None:
    params = SamplingParams(repetition_penalty=penalty, prompt_len=PROMPT_LEN)
    ours = penalize(LOGITS, params, HISTORY, len(HISTORY))
    theirs = transformers([generation.RepetitionPenaltyLogitsProcessor(penalty)], HISTORY,
                          LOGITS)
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    assert not np.allclose(ours, LOGITS)


@pytest.mark.parametrize("presence,frequency", [(0.8, 0.0), (0.0, 0.6), (-0.5, 1.2)])
def test_presence_and_frequency_penalties_are_openais(presence: float, frequency: float
                                                      ) -> None:
    # OpenAI: mu[j] -> mu[j] - c[j] * frequency - float(c[j] > 0) * presence, where c[j]
    # counts token j in the completion so far (the prompt not included, as in vLLM).
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                            prompt_len=PROMPT_LEN)
    counts = np.zeros(VOCAB)
    for token in HISTORY[PROMPT_LEN:]:
        counts[token] += 1
    expected = LOGITS[0] - counts * frequency - (counts > 0) * presence
    np.testing.assert_allclose(penalize(LOGITS, params, HISTORY, len(HISTORY))[0], expected,
                               atol=1e-6)


def test_logit_bias_is_added_and_can_ban_a_token() -> None:
    params = SamplingParams(logit_bias=((3, 5.0), (7, -100.0)))
    expected = LOGITS[0].astype(np.float64).copy()
    expected[3] += 5.0
    expected[7] -= 100.0
    np.testing.assert_allclose(penalize(LOGITS, params, HISTORY, len(HISTORY))[0], expected,
                               atol=1e-6)
    probs = process_logits(LOGITS, SamplingParams(logit_bias=((7, -100.0),)), HISTORY,
                           len(HISTORY))
    assert probs[0, 7] < 1e-30


@pytest.mark.parametrize("min_p,temperature", [(0.1, 1.0), (0.05, 0.7), (0.5, 1.5)])
def test_min_p_is_transformers(min_p: float, temperature: float) -> None:
    ours = process_logits(LOGITS, SamplingParams(temperature=temperature, min_p=min_p))
    theirs = transformers([generation.TemperatureLogitsWarper(temperature),
                           generation.MinPLogitsWarper(min_p)], HISTORY, LOGITS)
    expected = torch.softmax(torch.tensor(theirs), -1).numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-6)
    assert (ours == 0).any()


def test_the_whole_chain_is_transformers_order() -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                            repetition_penalty=1.2, prompt_len=PROMPT_LEN)
    ours = process_logits(LOGITS, params, HISTORY, len(HISTORY))
    theirs = transformers([generation.RepetitionPenaltyLogitsProcessor(1.2),
                           generation.TemperatureLogitsWarper(0.8),
                           generation.TopKLogitsWarper(20), generation.TopPLogitsWarper(0.9),
                           generation.MinPLogitsWarper(0.05)], HISTORY, LOGITS)
    np.testing.assert_allclose(ours, torch.softmax(torch.tensor(theirs), -1).numpy(),
                               atol=1e-6)


def test_a_blocks_rows_follow_the_tokens_drafted_before_them() -> None:
    params = SamplingParams(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.5,
                            frequency_penalty=0.3, logit_bias=((1, 2.0),), min_p=0.02,
                            prompt_len=PROMPT_LEN)
    rows = RNG.normal(0, 3, size=(5, VOCAB)).astype(np.float32)
    start = 20  # rows follow HISTORY[:20], [:21], ... [:24]
    block = process_logits(rows, params, HISTORY, start)
    for i in range(5):
        alone = process_logits(rows[i:i + 1], params, HISTORY[:start + i], start + i)
        np.testing.assert_allclose(block[i], alone[0], atol=1e-12)
    greedy = SamplingParams(temperature=0, repetition_penalty=50.0)
    top = int(np.argmax(LOGITS[0]))
    assert process_logits(LOGITS, greedy, [top], 1)[0].argmax() != top  # penalized away


def test_penalties_need_the_history() -> None:
    with pytest.raises(ValueError, match="history"):
        process_logits(LOGITS, SamplingParams(repetition_penalty=1.2))
