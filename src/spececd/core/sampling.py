"""Logits processing and sampling: pure NumPy, explicit RNG.

`process_logits` turns raw logits into the distribution a model samples from. First the
penalties, which depend on the tokens so far (:func:`penalize`): the repetition penalty
(transformers' ``RepetitionPenaltyLogitsProcessor``, over the prompt and the generated
tokens), the presence and frequency penalties (OpenAI's definition, as vLLM applies it:
over the generated tokens only), then ``logit_bias`` (added to the logits), then token
healing's mask (``heal_ids``: at the first generated position, the position
``prompt_len``, every other token is removed; :mod:`spececd.healing`). Then
temperature, top-k, top-p and min-p, with the semantics of transformers'
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` (ties with the k-th score are kept),
``TopPLogitsWarper`` (the smallest set whose mass exceeds ``top_p``, at least one token)
and ``MinPLogitsWarper`` (tokens below ``min_p`` times the most likely one's probability
go). Temperature 0 means greedy: a one-hot distribution on the first argmax of the
penalized logits.

The drafter's distribution is sent to the verifier as a :class:`SparseProbs` (support ids
plus probabilities). Both sides read it through :meth:`SparseProbs.normalized`, so the
drafter samples from exactly the distribution the verifier sees: that is what keeps
``exact`` verification lossless.

Randomness is never global: every draw takes a ``numpy.random.Generator``. `round_rng`
derives one from (seed, stream, position), so a round's randomness depends only on where
it is in the sequence, never on what happened before; a retried or resumed round draws
the same numbers.

The settings come in a :class:`~spececd.core.params.SamplingParams`, checked when it was
made (:mod:`spececd.core.params`, the records' home; a
:class:`~spececd.core.params.Constraint` is compiled against a tokenizer and masks logits
in :mod:`spececd.grammar`, not here).

This module knows nothing about models, tokenizers or the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The records' home is spececd.core.params; nothing inside imports them from here. They
# stay importable from here for users who followed the API reference (SamplingParams is
# used below too).
from spececd.core.params import Constraint as Constraint
from spececd.core.params import Mode as Mode
from spececd.core.params import SamplingParams as SamplingParams

# Streams of `round_rng`: the verifier's and the drafter's randomness must be independent.
VERIFIER_STREAM = 0
DRAFTER_STREAM = 1


def round_rng(seed: int, stream: int, position: int) -> np.random.Generator:
    """The generator for one round: a pure function of seed, stream and position."""
    return np.random.default_rng([seed, stream, position])


def _softmax(scores: np.ndarray) -> np.ndarray:  # [n, vocab] -> [n, vocab]
    shifted = scores - scores.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def penalize(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
             start: int) -> np.ndarray:
    """The penalties and biases of ``params`` applied to ``logits`` ``[n, vocab]``, where
    row ``i`` is the distribution after ``history[:start + i]`` (a block's rows follow
    its drafted tokens), and token healing's mask at row ``params.prompt_len - start``.
    Returns float64 logits (the input when nothing applies)."""
    if not params.penalized:
        return logits
    scores = logits.astype(np.float64)
    n, vocab = scores.shape
    if start + n - 1 > len(history):
        raise ValueError(f"{n} rows after {start} tokens need {start + n - 1} tokens of "
                         f"history, got {len(history)}")
    tokens = np.asarray(history[:start + n - 1], dtype=np.int64)
    first_generated = min(params.prompt_len, start)
    seen = np.bincount(tokens[:start], minlength=vocab)[:vocab] > 0  # prompt and output
    counts = np.bincount(tokens[first_generated:start], minlength=vocab)[:vocab]  # output
    bias = np.zeros(vocab)
    for token, value in params.logit_bias:
        if token < vocab:
            bias[token] += value
    for i in range(n):
        if i:  # the previous row's token is history now
            token = int(tokens[start + i - 1])
            seen[token] = True
            if start + i - 1 >= params.prompt_len:
                counts[token] += 1
        row = scores[i]
        if params.repetition_penalty != 1.0:
            picked = row[seen]
            row[seen] = np.where(picked > 0, picked / params.repetition_penalty,
                                 picked * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        row += bias
    healed = params.prompt_len - start  # the row of the first generated position
    if params.heal_ids and 0 <= healed < n:
        allowed = np.asarray([t for t in params.heal_ids if t < vocab], dtype=np.int64)
        kept = scores[healed, allowed]
        scores[healed] = -np.inf
        scores[healed, allowed] = kept
    return scores


def process_logits(logits: np.ndarray, params: SamplingParams,
                   history: Sequence[int] | None = None, start: int = 0) -> np.ndarray:
    """Logits ``[n, vocab]`` to float64 probabilities ``[n, vocab]`` per `params`; row
    ``i`` follows ``history[:start + i]``, which the penalties need (:func:`penalize`)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    if params.greedy:
        n, vocab = logits.shape
        probs = np.zeros((n, vocab), dtype=np.float64)
        probs[np.arange(n), greedy_tokens(logits, params, history, start)] = 1.0
        return probs
    if params.penalized:
        if history is None:
            raise ValueError("penalties and biases need the token history")
        logits = penalize(logits, params, history, start)
    n, vocab = logits.shape
    scores = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < vocab:
        kth = np.partition(scores, vocab - params.top_k, axis=-1)[:, vocab - params.top_k]
        scores[scores < kth[:, None]] = -np.inf
    if params.top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending
        cumulative = np.cumsum(_softmax(np.take_along_axis(scores, order, axis=-1)), axis=-1)
        remove = cumulative <= 1.0 - params.top_p
        remove[:, -1] = False  # always keep the most likely token
        np.put_along_axis(
            scores, order, np.where(remove, -np.inf, np.take_along_axis(scores, order, -1)), -1
        )
    probs = _softmax(scores)
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(axis=-1, keepdims=True), 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def greedy_tokens(logits: np.ndarray, params: SamplingParams,
                  history: Sequence[int] | None = None, start: int = 0) -> np.ndarray:
    """The token each row ``[n, vocab]`` of ``logits`` picks at temperature 0 (after the
    penalties and biases of ``params``, as :func:`process_logits`): ``[n]`` integers, the
    point masses :func:`process_logits` returns as one-hot rows."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    if params.penalized:
        if history is None:
            raise ValueError("penalties and biases need the token history")
        logits = penalize(logits, params, history, start)
    return logits.argmax(axis=-1)  # type: ignore[no-any-return]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from ``probs`` ``[vocab]`` (non-negative, positive sum) by inverse CDF."""
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    # Rounding can push the draw past the end; land on the last token with mass.
    return min(index, int(np.flatnonzero(probs)[-1]))


@dataclass(frozen=True)
class SparseProbs:
    """A draft distribution over a support: ``ids`` ``[m]`` int64, ``probs`` ``[m]`` float32.

    The distribution is ``probs / probs.sum()`` (see :meth:`normalized`); ids are unique.
    """

    ids: np.ndarray
    probs: np.ndarray

    def normalized(self) -> np.ndarray:  # [m] float64
        """The probabilities as float64, summing to 1: the distribution both sides read."""
        p = self.probs.astype(np.float64)
        return p / p.sum()  # type: ignore[no-any-return]

    def prob_of(self, token: int) -> float:
        """The normalized probability of ``token`` (0 outside the support)."""
        hit = np.flatnonzero(self.ids == token)
        return float(self.normalized()[hit[0]]) if hit.size else 0.0

    def dense(self, vocab: int) -> np.ndarray:  # [vocab] float64
        """The normalized distribution as a dense float64 array ``[vocab]``."""
        out = np.zeros(vocab, dtype=np.float64)
        out[self.ids] = self.normalized()
        return out

    @classmethod
    def from_dense(cls, probs: np.ndarray, max_support: int = 0) -> SparseProbs:
        """The non-zero part of ``probs`` ``[vocab]``, cut to the ``max_support`` most
        likely tokens when ``max_support > 0`` (the drafter then samples from the cut)."""
        ids = np.flatnonzero(probs)
        if 0 < max_support < ids.size:
            ids = ids[np.argpartition(probs[ids], ids.size - max_support)[-max_support:]]
            ids.sort()
        kept = probs[ids]
        return cls(ids=ids.astype(np.int64), probs=(kept / kept.sum()).astype(np.float32))


def draft_distribution(logits: np.ndarray, params: SamplingParams, max_support: int,
                       history: Sequence[int]) -> SparseProbs:
    """The sparse distribution a drafter samples from, for the ``logits`` ``[vocab]`` of
    the position after ``history``."""
    return SparseProbs.from_dense(
        process_logits(logits[None, :], params, history, len(history))[0], max_support)


def sample_sparse(dist: SparseProbs, rng: np.random.Generator) -> int:
    """Draw one token id from ``dist`` (its normalized probabilities) with ``rng``."""
    return int(dist.ids[sample(dist.normalized(), rng)])
