"""The backend conformance loop: after any sequence of extend/truncate calls, ``extend``
returns the logits a fresh forward pass over the same tokens gives.

:func:`worst_difference` drives one sequence of a backend through random extends (some
keeping only their last positions) and truncations, and returns the largest difference
from ``fresh``; :func:`transformers_fresh` is the fresh pass of a transformers folder, the
reference of the backends that run converted models.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Fresh = Callable[[list[int]], np.ndarray]  # tokens -> [len(tokens), vocab] logits


def worst_difference(backend: Any, fresh: Fresh, seed: int, steps: int = 25,
                     size: int = 120) -> float:
    """The largest |difference| between what ``backend``'s sequence returns over ``steps``
    random extends (of 1 to 8 tokens, over ``size`` random ones) and truncations, and
    ``fresh``."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, backend.vocab_size, size=size)]
    seq = backend.new_sequence()
    worst = 0.0
    for _ in range(steps):
        if seq.tokens and rng.random() < 0.4:
            seq.truncate(int(rng.integers(0, len(seq.tokens) + 1)))
            continue
        n = len(seq.tokens)
        add = int(rng.integers(1, 9))
        new = [int(t) for t in rng.integers(0, backend.vocab_size, size=add)]
        tokens[n:n + add] = new
        keep = int(rng.integers(0, add + 1)) if rng.random() < 0.5 else None
        logits = seq.extend(new, keep=keep)
        assert seq.tokens == tokens[:n + add]
        expected = fresh(tokens[:n + add])[n:]
        expected = expected if keep is None else expected[add - keep:]
        assert logits.shape == expected.shape
        if logits.size:
            worst = max(worst, difference(logits, expected))
    return worst


def difference(logits: np.ndarray, expected: np.ndarray) -> float:
    """max |logits - expected|, infinite where either holds NaN (which ``max`` of floats
    would pass over: ``max(0.0, nan)`` is 0.0)."""
    worst = float(np.abs(logits - expected).max())
    return worst if np.isfinite(worst) else float("inf")


def transformers_fresh(folder: Path) -> Fresh:
    """A fresh float32 forward pass of the transformers model in ``folder`` (loaded once)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def fresh(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float().numpy()  # type: ignore[no-any-return]

    return fresh
