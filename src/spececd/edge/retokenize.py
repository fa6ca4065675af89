"""Drafting with a model whose tokenizer is not the target's, losslessly: string-level
exact match (Timor et al., ICML 2025, "SLEM").

The edge's history stays in target token ids (the verifier's, and the authoritative
one). Each round :class:`CrossDrafter` decodes it to text, encodes that text with the
draft's tokenizer (the draft model's own view, whose KV cache is reused up to the first
id that changed), drafts a block there, and turns the block's text back into target ids:
the last few committed target tokens are decoded, the draft's text appended, and the
whole re-encoded with the target's tokenizer. Only the ids past the committed ones are
sent, and only when the re-encoding starts with exactly those committed ids (token
boundaries realigned), so committed tokens are never rewritten. The verifier checks the
target ids in ``match`` mode (or greedy): it keeps a drafted token only where it equals
the target's own sample, so every emitted token is the target's and the output is
exact under sampling as under greedy decoding. Drafts that do not realign cost
acceptance, never correctness.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from spececd.backends.base import Backend, Tokenizer
from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import TreeShape
from spececd.core.sampling import SparseProbs
from spececd.edge.drafter import Drafter, Tree

LOOK_BEHIND = 4  # committed target tokens re-encoded with the draft's text


class CrossDrafter:
    """A :class:`~spececd.edge.drafter.Drafter` for ``backend`` that takes and returns
    ``target``'s token ids. It reports no distributions: verification is by match. It
    drafts unconstrained (the verifier masks), so it forces nothing."""

    forced = 0
    looked_up = 0

    def __init__(self, backend: Backend, target: Tokenizer,
                 lock: threading.Lock | None = None) -> None:
        self.backend = backend
        self.target = target
        self.drafter = Drafter(backend, lock)

    def forced_among(self, history: Sequence[int], tokens: Sequence[int]
                     ) -> tuple[int, ...]:
        return ()

    def looked_up_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        return ()

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        return None  # every token is a model step

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        """Up to ``k`` target ids drafted after ``history`` (target ids); fewer, or none,
        where the draft's text does not realign with the target's token boundaries."""
        own_tokenizer = self.backend.tokenizer
        own = own_tokenizer.encode(self.target.decode(history))
        # Penalties, biases and healing's mask name target ids and count target tokens:
        # they stay with the verifier. The draft samples with the rest, which is all a good
        # guess needs. So does a constraint: the verifier's mask alone keeps the output valid.
        guess = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0,
                                    frequency_penalty=0.0, logit_bias=(), prompt_len=0,
                                    constraint=None, heal_ids=())
        drafted, _ = self.drafter.draft(own, k, Mode.MATCH, guess, seed, max_support)
        before = own_tokenizer.decode(own)
        text = own_tokenizer.decode([*own, *drafted]).rstrip("\ufffd")  # no cut character
        if not text.startswith(before) or len(text) == len(before):
            return (), None
        behind = list(history[-LOOK_BEHIND:])
        ids = self.target.encode(self.target.decode(behind) + text[len(before):], bos=False)
        if ids[:len(behind)] != behind:
            return (), None  # the boundary moved: drafting on would rewrite committed tokens
        return tuple(ids[len(behind):len(behind) + k]), None

    def tree(self, history: Sequence[int], k: int, shape: TreeShape, mode: Mode,
             params: SamplingParams, seed: int, max_support: int) -> Tree:
        """A chain: a draft's token boundaries are not the target's, so its candidates for
        one target position are not comparable."""
        return Tree.of_chain(*self.draft(history, k, mode, params, seed, max_support))
