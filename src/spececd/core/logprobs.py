"""Log-probabilities of tokens under the target: what ``logprobs`` and ``echo`` report.

They are the target's own, computed by the verifier from the logits of the pass that
decided each token (so speculative and cloud-only generation report the same values, and
a rejected-and-corrected position reports the target's log-probability of the token it
emitted, not of the draft's). Which distribution, as vLLM's ``logprobs_mode`` names it:

- ``raw_logprobs`` (the default, as in vLLM): ``log_softmax`` of the model's raw logits,
  before penalties, ``logit_bias``, temperature or any filter;
- ``processed_logprobs``: the log of the distribution the token is drawn from
  (:func:`~spececd.core.sampling.process_logits`: penalties and ``logit_bias``, then
  temperature, top-k, top-p and min-p; a filtered-out token has ``-inf``). At temperature
  0 (greedy), the ``log_softmax`` of the penalized logits, without temperature, as vLLM
  does.

vLLM's ``raw_logits`` and ``processed_logits`` (logits instead of log-probabilities) are
not offered. A prompt's log-probabilities (``echo``) are always raw: prompt tokens are not
sampled (vLLM: "for prompt_logprobs, processed_* and raw_* yield identical results").

:class:`Logprobs` holds them for consecutive tokens as arrays (how they cross the wire);
:class:`TokenLogprob` is one token's, as the Python API hands them out. Which ones a session
asks for, and their limits, are in :mod:`spececd.core.params` (``SamplingParams.logprobs``).
This module is pure NumPy and knows nothing of models or the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spececd.core.params import RAW, SamplingParams
from spececd.core.sampling import penalize, process_logits


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the ``top`` most likely tokens at its position,
    ``(token id, log-probability)``, most likely first (ties: the lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of ``n`` consecutive tokens: ``chosen`` ``[n]`` float32, each
    token's own; ``top_ids`` ``[n, top]`` int64 and ``top_logprobs`` ``[n, top]`` float32,
    the most likely tokens at each position, most likely first. The token ids themselves
    are the receiver's (the tokens it was sent, or its prompt)."""

    chosen: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def __post_init__(self) -> None:
        n = self.chosen.shape[0]
        if self.chosen.ndim != 1 or self.top_ids.ndim != 2 or self.top_ids.shape[0] != n \
                or self.top_logprobs.shape != self.top_ids.shape:
            raise ValueError(f"logprobs of mismatched shapes: chosen {self.chosen.shape}, "
                             f"top ids {self.top_ids.shape}, top {self.top_logprobs.shape}")

    def __len__(self) -> int:
        return int(self.chosen.shape[0])

    @property
    def top(self) -> int:
        """Alternatives per token (the width of ``top_ids``)."""
        return int(self.top_ids.shape[1])

    def rows(self, start: int, stop: int | None = None) -> Logprobs:
        """The tokens ``start:stop``."""
        return Logprobs(self.chosen[start:stop], self.top_ids[start:stop],
                        self.top_logprobs[start:stop])

    def entries(self, token_ids: Sequence[int]) -> tuple[TokenLogprob, ...]:
        """Per token of ``token_ids`` (as many as rows), for the Python API."""
        if len(token_ids) != len(self):
            raise ValueError(f"{len(token_ids)} tokens for {len(self)} rows of logprobs")
        return tuple(
            TokenLogprob(int(token), float(self.chosen[i]),
                         tuple(zip(self.top_ids[i].tolist(),
                                   self.top_logprobs[i].astype(np.float64).tolist(),
                                   strict=True)))
            for i, token in enumerate(token_ids))

    @classmethod
    def concat(cls, parts: Sequence[Logprobs]) -> Logprobs:
        """The rows of ``parts``, in order, as one (raises ``ValueError`` when there are
        none)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        return cls(np.concatenate([p.chosen for p in parts]),
                   np.concatenate([p.top_ids for p in parts]),
                   np.concatenate([p.top_logprobs for p in parts]))

    @classmethod
    def empty(cls, top: int) -> Logprobs:
        """No rows, ``top`` alternatives wide."""
        return cls(np.zeros(0, np.float32), np.zeros((0, top), np.int64),
                   np.zeros((0, top), np.float32))


def log_softmax(logits: np.ndarray) -> np.ndarray:  # [n, vocab] -> [n, vocab] float64
    """The float64 log-probabilities of each row of ``logits`` ``[n, vocab]``, computed
    stably (the largest logit subtracted first)."""
    scores = logits.astype(np.float64)
    shifted = scores - scores.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # type: ignore[no-any-return]


def distribution_logprobs(logits: np.ndarray, mode: str, params: SamplingParams,
                          history: Sequence[int] | None = None, start: int = 0
                          ) -> np.ndarray:
    """The log-probabilities ``[n, vocab]`` (float64) that ``mode`` reports for the rows
    of ``logits`` ``[n, vocab]``; ``processed_logprobs`` needs the session's
    :class:`~spececd.core.params.SamplingParams` and the tokens each row follows
    (``history[:start + i]`` for row ``i``, see :func:`~spececd.core.sampling.penalize`)."""
    if mode == RAW:
        return log_softmax(logits)
    if params.greedy:
        if params.penalized:
            assert history is not None, "penalties need the token history"
            logits = penalize(logits, params, history, start)
        return log_softmax(logits)
    with np.errstate(divide="ignore"):  # filtered tokens: log(0) = -inf
        return np.log(process_logits(logits, params, history, start))  # type: ignore[no-any-return]


def token_logprobs(logprobs: np.ndarray, tokens: Sequence[int], top: int) -> Logprobs:
    """Each row's token's entry of ``logprobs`` ``[n, vocab]`` and the row's ``top`` most
    likely tokens, most likely first (ties: the lower id first)."""
    n, vocab = logprobs.shape
    if len(tokens) != n:
        raise ValueError(f"{len(tokens)} tokens for {n} rows")
    chosen = logprobs[np.arange(n), np.asarray(tokens, dtype=np.int64)]
    top = min(top, vocab)
    if top:
        # The top candidates, then sorted by (logprob descending, id ascending).
        part = np.argpartition(-logprobs, top - 1, axis=-1)[:, :top] if top < vocab else \
            np.broadcast_to(np.arange(vocab), (n, vocab))
        values = np.take_along_axis(logprobs, part, axis=-1)
        # A tie at the cut may leave a higher id in and a lower one out: take every id that
        # ties the cut's value, then sort and cut again.
        cut = values.min(axis=-1, keepdims=True)
        ids = np.empty((n, top), np.int64)
        for i in range(n):
            candidates = np.union1d(part[i], np.flatnonzero(logprobs[i] == cut[i]))
            order = np.lexsort((candidates, -logprobs[i, candidates]))[:top]
            ids[i] = candidates[order]
        top_values = np.take_along_axis(logprobs, ids, axis=-1)
    else:
        ids, top_values = np.zeros((n, 0), np.int64), np.zeros((n, 0))
    return Logprobs(chosen.astype(np.float32), ids, top_values.astype(np.float32))
