"""Chi-square goodness of fit with sparse cells pooled, shared by the statistical tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

# Draws of an end-to-end chi-square test over a 10-word pair (tests/builders.py's
# vocab_pair): its first two tokens, 100 cells. What they catch was measured with a planted
# bug, the wire's draft probabilities shifted by one against their ids
# (tests/e2e/test_transports.py's test_a_draft_distribution_shifted_on_the_wire_is_caught):
# p = 3e-5 at 1,000 draws, 3e-12 at 1,500, 1e-28 at 3,000. A drafter that reports its
# distribution before top-p (5% of the mass moved on this pair) went unseen at 3,000 as at
# 1,500: subtle errors are the in-process tests' to catch, with their 20,000 draws
# (tests/core). 3,000 was the figure before (2026-11-30); 1,500 halves these tests.
PAIR_DRAWS = 1500


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of ``observed`` counts against ``expected`` counts (same total). Cells
    expected below 5 are pooled into one; a count in a cell of probability 0 gives 0."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    if observed[expected == 0].sum() > 0:
        return 0.0
    keep = expected >= 5
    obs, exp = list(observed[keep]), list(expected[keep])
    if expected[~keep].sum() > 0:
        obs.append(observed[~keep].sum())
        exp.append(expected[~keep].sum())
    exp_arr = np.array(exp) * sum(obs) / sum(exp)
    return float(stats.chisquare(np.array(obs), exp_arr).pvalue)


def first_token_p_value(gen: Any, target: Path, draws: int,
                        prompt: str = "import os\n\nclass ") -> float:
    """p-value of ``draws`` sampled first tokens (temperature 1, top-k 20) of ``gen``, a
    :class:`~spececd.generator.Generator`, against ``target``'s own distribution for them."""
    from spececd.backends.registry import load_backend
    from spececd.core.params import SamplingParams
    from spececd.core.sampling import process_logits

    ids = gen.prompt_ids(prompt)
    params = SamplingParams(temperature=1.0, top_k=20)
    outs = gen.generate_n(ids, draws, max_tokens=2, temperature=1.0, top_k=20, seed=11,
                          stop_token_ids=[])
    seq = load_backend(str(target), device="cpu", dtype="float32").new_sequence()
    probs = process_logits(seq.extend(ids, keep=1), params)[0]
    observed = np.bincount([o.token_ids[0] for o in outs], minlength=probs.size)
    return chi_square_p(observed, probs * draws)
