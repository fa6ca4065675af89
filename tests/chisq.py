"""Chi-square goodness of fit with sparse cells pooled, shared by the statistical tests."""

from __future__ import annotations

import numpy as np
from scipy import stats


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
