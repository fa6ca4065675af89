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

It also drafts **trees** (:meth:`Drafter.tree`): the same chain, plus, at each step, up
to ``width - 1`` sibling leaves from the distribution that step drew from, shaped by a
:class:`~spececd.core.policy.TreeShape`. A sibling costs no draft forward pass and one
position of the verifier's pass; where the target rejects the chain's token, a sibling
may still be its token. At depth ``i`` a candidate ``s`` is worth ``reach[i] * q(s)``
tokens in expectation and is sent when that is at least the shape's ``floor``: where the
draft is sure, or the verifier's positions are dear, the chain goes alone. Siblings are
the most likely such tokens (greedy, ``match``: the verifier compares ids only) or, in
``exact`` mode, draws without replacement, each reported with the distribution it was
drawn from; whether to draw one more is decided before the draw (from the mass left,
``reach[i] * mass >= floor``), so that each sibling follows its reported distribution.

Under a constraint (``params.constraint``) it drafts as the verifier verifies: a
:class:`~spececd.grammar.ConstraintMatcher`, moved to the history's generated tokens
(rolling back whatever the verifier rejected), masks the draft's logits before anything
else, so the distribution it reports is the one it sampled from and every draft is one the
constraint allows (a history the constraint refuses, which only a verifier that does not
enforce it would produce, is drafted after unconstrained). Where the constraint allows a
single token, that token is proposed
without running the draft model (jump-forward drafting), with a point-mass distribution in
``exact`` mode; :attr:`Drafter.forced` counts them, and :meth:`Drafter.forced_among` says
which tokens of an output were such (the verifier, masking with the same constraint, can
only have kept them: a forced token is a property of the history before it).

The drafter knows nothing about the network or the verifier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from spececd.backends.base import Backend, sync
from spececd.core.params import Constraint, Mode, SamplingParams
from spececd.core.policy import TreeShape
from spececd.core.sampling import (
    DRAFTER_STREAM,
    SparseProbs,
    draft_distribution,
    penalize,
    process_logits,
    round_rng,
    sample,
    sample_sparse,
)
from spececd.core.tokens import common_prefix
from spececd.errors import InputError
from spececd.grammar import ConstraintMatcher, grammars_for, mask_logits

log = logging.getLogger(__name__)

CHAIN = TreeShape(width=1, budget=0, reach=(), floor=0.0)  # the shape of a plain draft


@dataclass(frozen=True)
class Tree:
    """A drafted tree: ``tokens`` in node order, each with its parent (``-1``: after the
    history) and, in exact mode, the distribution it was drawn from; ``chain`` lists the
    nodes of the main line, the one a draft of width 1 would have drafted."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    dists: tuple[SparseProbs, ...] | None
    chain: tuple[int, ...]

    @classmethod
    def of_chain(cls, tokens: tuple[int, ...], dists: tuple[SparseProbs, ...] | None) -> Tree:
        """The chain of ``tokens`` (drawn from ``dists``, one each, or None) as a tree: each
        node the child of the one before."""
        return cls(tokens, tuple(range(-1, len(tokens) - 1)), dists, tuple(range(len(tokens))))

    def trunk(self) -> Tree:
        """The main chain alone, as a tree (what a server without trees is sent)."""
        dists = self.dists
        return Tree.of_chain(tuple(self.tokens[i] for i in self.chain),
                             None if dists is None else tuple(dists[i] for i in self.chain))

    @property
    def branched(self) -> bool:
        """Whether any node has a sibling (else the tree is its chain)."""
        return len(self.chain) < len(self.tokens)

    def siblings(self) -> tuple[tuple[int, int], ...]:
        """The nodes off the chain (leaves, as drafted here) as ``(i, token)``: a
        candidate in place of the chain's ``i``-th token (what a stream-drafting hint
        carries as its alternatives)."""
        depth = {self.parents[node]: i for i, node in enumerate(self.chain)}
        chain = set(self.chain)
        return tuple((depth[self.parents[j]], token) for j, token in enumerate(self.tokens)
                     if j not in chain)


class Marks:
    """Positions of a history that a draft source proposed a certain way (forced by a
    constraint, looked up), to say which emitted tokens were: ``lineage`` is the last
    draft's history and tokens, ``at`` the marked positions in it. A position past what a
    later history still shares is forgotten: it was a proposal of a round no longer held."""

    def __init__(self) -> None:
        self.lineage: list[int] = []
        self.at: set[int] = set()

    def keep(self, history: Sequence[int]) -> None:
        """Forget the marks past what ``history`` shares with the lineage."""
        kept = common_prefix(self.lineage, history)
        self.at = {p for p in self.at if p < kept}

    def among(self, history: Sequence[int], tokens: Sequence[int]) -> tuple[int, ...]:
        """The indices of ``tokens`` (emitted after ``history``) at marked positions, as
        long as they are the lineage's own tokens."""
        if not self.at:
            return ()
        start, lineage = len(history), self.lineage
        if common_prefix(lineage, history) < start:
            return ()
        same = common_prefix(lineage[start:], tokens)
        return tuple(i for i in range(same) if start + i in self.at)


class DraftSource(Protocol):
    """What the edge loop drafts with: :class:`Drafter`, a
    :class:`~spececd.edge.retokenize.CrossDrafter` for a draft with another tokenizer
    (which drafts chains only: its ``tree`` is its chain), the model-free sources of
    :mod:`spececd.edge.lookup`, or a :class:`~spececd.edge.sources.HybridDraft` of both.
    ``forced``: the tokens drafted so far that a constraint forced, proposed without the
    draft model; ``looked_up``: those proposed by lookup, also without it."""

    @property
    def forced(self) -> int:
        """Tokens drafted so far that a constraint forced (no other was allowed)."""

    @property
    def looked_up(self) -> int:
        """Tokens drafted so far by lookup, without the draft model."""

    def forced_among(self, history: Sequence[int], tokens: Sequence[int]
                     ) -> tuple[int, ...]:
        """The indices of ``tokens`` (emitted after ``history``) this source proposed
        because a constraint allowed no other token."""
        ...

    def looked_up_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        """The indices of ``tokens`` (emitted after ``history``) this source looked up."""
        ...

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        """A chain of up to ``k`` tokens drafted after ``history`` and, in exact mode, the
        distribution each was drawn from (cut to its ``max_support`` most likely tokens);
        ``seed`` makes the draws a function of the position."""

    def tree(self, history: Sequence[int], k: int, shape: TreeShape, mode: Mode,
             params: SamplingParams, seed: int, max_support: int) -> Tree:
        """A draft of depth up to ``k`` after ``history``, branched where ``shape`` says (a
        source that drafts chains only returns its chain)."""

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        """The draft after ``history`` where this source proposes one without a model step
        (a lookup's match, a prediction the output follows), as :meth:`tree` drafts it
        (``shape`` None: a chain) but never continued by a model; None where it would
        draft with a model or proposes nothing. Whether it is None depends on the history
        alone, so that a round's draft length may follow it losslessly."""


class Drafter:
    """``lock``: held for each call, so drafters of one backend (one per concurrent
    session, each with its own KV cache) never run the model at the same time."""

    def __init__(self, backend: Backend, lock: threading.Lock | None = None) -> None:
        self.backend = backend
        self.sequence = backend.new_sequence()
        self.lock = lock or threading.Lock()
        self.forced = 0
        self.looked_up = 0  # a model drafts: nothing is looked up
        self._matcher: ConstraintMatcher | None = None
        self._warned = False  # about a history the constraint refuses (said once)
        # Under a constraint: the last call's history and chain, and the positions in
        # them whose token the constraint forced.
        self._forced_at = Marks()

    def _constraint(self, constraint: Constraint | None) -> ConstraintMatcher | None:
        if constraint is None:
            return None
        if self._matcher is None or self._matcher.compiled.constraint != constraint:
            grammars = grammars_for(self.backend.tokenizer, self.backend.vocab_size)
            self._matcher = grammars.compile(constraint).matcher()
            self._warned = False
        return self._matcher

    def forced_among(self, history: Sequence[int], tokens: Sequence[int]
                     ) -> tuple[int, ...]:
        """The indices of ``tokens`` (emitted after ``history``) whose token this drafter
        proposed because the constraint allowed no other, after the same history. (Its
        session's thread alone drafts with it and asks: no lock, which every session of
        the draft model shares.)"""
        return self._forced_at.among(history, tokens)

    def looked_up_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        return ()

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        return None  # every token is a model step

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        """Draft ``k`` tokens after ``history``; return them and, in exact sampling mode,
        the distribution each was drawn from (cut to its ``max_support`` most likely
        tokens)."""
        tree = self.tree(history, k, CHAIN, mode, params, seed, max_support)
        return tree.tokens, tree.dists

    def tree(self, history: Sequence[int], k: int, shape: TreeShape, mode: Mode,
             params: SamplingParams, seed: int, max_support: int) -> Tree:
        """A chain of ``k`` tokens after ``history``, branched as ``shape`` says (see the
        module docstring)."""
        with self.lock:
            return self._tree(history, k, shape, mode, params, seed, max_support)

    def _tree(self, history: Sequence[int], k: int, shape: TreeShape, mode: Mode,
              params: SamplingParams, seed: int, max_support: int) -> Tree:
        feed = sync(self.sequence, history)
        tokens: list[int] = []
        parents: list[int] = []
        dists: list[SparseProbs] = []
        chain: list[int] = []
        report = mode is Mode.EXACT and not params.greedy
        context = list(history)  # penalties count the tokens drafted so far too
        matcher = self._constraint(params.constraint)
        if matcher is not None:
            try:
                matcher.sync(history[params.prompt_len:])
            except InputError as exc:  # the verifier is the authority: draft unconstrained
                if not self._warned:
                    log.warning("drafting without the constraint: %s", exc)
                    self._warned = True
                matcher = None
        # Forced positions the history still shares stay known; the rest are gone.
        self._forced_at.keep(history if matcher is not None else [])
        for i in range(k):
            parent = chain[-1] if chain else -1
            forced = matcher.forced(1) if matcher is not None else []
            if forced:  # the only token allowed: no model step, no siblings
                token = forced[0]
                point = SparseProbs(np.array([token]), np.array([1.0], dtype=np.float32))
                chain.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                if report:
                    dists.append(point)
                self.forced += 1
                self._forced_at.at.add(len(context))
                context.append(token)
                feed.append(token)
                ok = matcher is not None and matcher.accept(token)
                assert ok, "a forced token is one the constraint allows"
                continue
            logits = self.sequence.extend(feed, keep=1)[0]  # [vocab]
            if matcher is not None:
                logits = mask_logits(logits[None, :], matcher.allowed_now()[None, :])[0]
            room = shape.budget - len(tokens) - (k - 1 - i)  # keep a place for the chain's rest
            siblings = min(shape.width, room) - 1
            # The least draft probability that makes a sibling here worth its position.
            least = shape.floor / shape.reach[i] if i < len(shape.reach) and \
                shape.reach[i] > 0 else float("inf")
            choices: list[tuple[int, SparseProbs | None]]
            if report:
                rng = round_rng(seed, DRAFTER_STREAM, len(history) + i)
                dist = draft_distribution(logits, params, max_support, context)
                token = sample_sparse(dist, rng)
                choices = [(token, dist), *_drawn_siblings(dist, token, rng, siblings, least)]
            else:
                if params.greedy:
                    scores = penalize(logits[None, :], params, context, len(context))[0]
                    token = int(np.argmax(scores))
                    # Siblings by the draft's confidence: its softmax at temperature 1.
                    probs = (process_logits(scores[None, :], SamplingParams())[0]
                             if siblings > 0 else scores)
                else:
                    probs = process_logits(logits[None, :], params, context, len(context))[0]
                    token = sample(probs, round_rng(seed, DRAFTER_STREAM, len(history) + i))
                choices = [(token, None), *((t, None) for t in _likely_siblings(
                    probs, token, siblings, least))]
            chain.append(len(tokens))
            for token_j, dist_j in choices:
                tokens.append(token_j)
                parents.append(parent)
                if dist_j is not None:
                    dists.append(dist_j)
            context.append(token)
            feed = [token]
            if matcher is not None and not matcher.accept(token):
                raise RuntimeError(f"the drafter drew token {token}, which its constraint "
                                   f"masked out")
        self._forced_at.lineage = context if matcher is not None else []
        return Tree(tuple(tokens), tuple(parents), tuple(dists) if report else None,
                    tuple(chain))


def _likely_siblings(probs: np.ndarray, token: int, n: int, least: float) -> list[int]:
    """Up to ``n`` of the most likely tokens in ``probs`` ``[vocab]`` other than
    ``token``, each with at least probability ``least`` (and more than 0)."""
    if n <= 0:
        return []
    top = np.argpartition(-probs, n)[:n + 1] if probs.size > n + 1 else np.arange(probs.size)
    top = top[np.argsort(-probs[top], kind="stable")]
    return [int(t) for t in top if t != token and probs[t] >= least and probs[t] > 0][:n]


def _drawn_siblings(dist: SparseProbs, token: int, rng: np.random.Generator, n: int,
                    least: float) -> list[tuple[int, SparseProbs]]:
    """Up to ``n`` siblings of ``token`` drawn from ``dist`` without replacement, each with
    the distribution it was drawn from, while the mass left is at least ``least``. Whether
    to draw the next one depends only on that mass, never on what the draw gives, so each
    sibling follows its distribution."""
    siblings: list[tuple[int, SparseProbs]] = []
    probs = dist.normalized()
    taken = [token]
    while len(siblings) < n:
        left = ~np.isin(dist.ids, taken)
        if not left.any() or probs[left].sum() < least:
            break
        rest = SparseProbs(dist.ids[left], (probs[left] / probs[left].sum()).astype(np.float32))
        sibling = sample_sparse(rest, rng)
        siblings.append((sibling, rest))
        taken.append(sibling)
    return siblings
