"""The drafter: proposes a block of tokens with the draft model and remembers the
distribution each was drawn from.

It keeps one KV cache across rounds and rolls it back lazily: each call first cuts the
cache to the longest prefix it shares with the (authoritative) history, so a rejected
block costs nothing extra and an accepted one is reused. The last drafted token is never
fed to the model; the next call feeds it if the verifier kept it.

What it samples from depends on the mode:

- ``exact``: the processed distribution (temperature, top-k, top-p), truncated to the
  ``max_support`` most likely tokens, and it reports exactly that distribution;
- ``match``: the full processed distribution; nothing is reported;
- temperature 0 (or ``greedy``): the argmax; nothing is reported.

The drafter knows nothing about the network or the verifier.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from spececd.backends.base import Backend, sync
from spececd.core.sampling import (
    DRAFTER_STREAM,
    Mode,
    SamplingParams,
    SparseProbs,
    draft_distribution,
    penalize,
    process_logits,
    round_rng,
    sample,
    sample_sparse,
)


class DraftSource(Protocol):
    """What the edge loop drafts with: :class:`Drafter`, or a
    :class:`~spececd.edge.retokenize.CrossDrafter` for a draft with another tokenizer."""

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]: ...


class Drafter:
    """``lock``: held for each call, so drafters of one backend (one per concurrent
    session, each with its own KV cache) never run the model at the same time."""

    def __init__(self, backend: Backend, lock: threading.Lock | None = None) -> None:
        self.backend = backend
        self.sequence = backend.new_sequence()
        self.lock = lock or threading.Lock()

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        """Draft ``k`` tokens after ``history``; return them and, in exact sampling mode,
        the distribution each was drawn from (cut to its ``max_support`` most likely
        tokens)."""
        with self.lock:
            return self._draft(history, k, mode, params, seed, max_support)

    def _draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
               seed: int, max_support: int
               ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        feed = sync(self.sequence, history)
        tokens: list[int] = []
        dists: list[SparseProbs] = []
        report = mode is Mode.EXACT and not params.greedy
        context = list(history)  # penalties count the tokens drafted so far too
        for i in range(k):
            logits = self.sequence.extend(feed, keep=1)[0]  # [vocab]
            if params.greedy:
                scores = penalize(logits[None, :], params, context, len(context))[0]
                token = int(np.argmax(scores))
            else:
                rng = round_rng(seed, DRAFTER_STREAM, len(history) + i)
                if report:
                    dist = draft_distribution(logits, params, max_support, context)
                    dists.append(dist)
                    token = sample_sparse(dist, rng)
                else:
                    probs = process_logits(logits[None, :], params, context, len(context))
                    token = sample(probs[0], rng)
            tokens.append(token)
            context.append(token)
            feed = [token]
        return tuple(tokens), (tuple(dists) if report else None)
