"""Where an edge session's drafts come from: the draft model, lookup, or both.

:class:`DraftSources` holds one session's sources by :class:`~spececd.edge.options.DraftKind`
and makes each the first time a generation asks for it: ``model`` (the draft model's
:class:`~spececd.edge.drafter.Drafter` or
:class:`~spececd.edge.retokenize.CrossDrafter`), ``lookup``
(:class:`~spececd.edge.lookup.NgramLookup`), ``suffix``
(:class:`~spececd.edge.lookup.SuffixDraft`) and ``hybrid`` (:class:`HybridDraft`). A session
keeps its sources across generations, so a suffix draft's memory of earlier generations
(``lookup_memory``, off by default) is that session's.

:class:`HybridDraft` proposes the lookup where it matches a suffix of at least
``min_match`` tokens, and asks the draft model elsewhere; one source, so the adaptive draft
length and the strategy chooser see one draft. Where the lookup's continuation is shorter
than the round's ``k``, ``extend`` has the model draft on after it. Whichever proposes, the
reported distributions are what each token was drawn from (one-hot for looked-up tokens),
so exact verification stays lossless.

:class:`PredictedDraft` puts a prediction of the output first (OpenAI's Predicted Outputs:
:class:`~spececd.edge.lookup.PredictionLookup`): the prediction where the output follows
it, the session's own source elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import TreeShape
from spececd.core.sampling import SparseProbs
from spececd.edge.drafter import DraftSource, Tree
from spececd.edge.lookup import (
    Lookup,
    NgramLookup,
    PredictionLookup,
    Proposals,
    SuffixDraft,
    reported,
)
from spececd.edge.options import DraftKind

HYBRID_MIN_MATCH = 6  # the suffix a lookup must match for the hybrid to take it
# The output tokens that must have followed a prediction since it was picked up for it to
# draft before the session's own source (at the start of the output, none): measured on
# the code-edit set with the default pair, the prediction's next token was the target's
# 36% of the time after 2 such tokens, 43% after 3, 53% after 4 (the draft model's first
# token is accepted about as often as that).
PREDICTION_MIN_RUN = 4


def drafted(source: DraftSource, history: Sequence[int], k: int, shape: TreeShape | None,
            mode: Mode, params: SamplingParams, seed: int, max_support: int) -> Tree:
    """``source``'s tree after ``history`` where a round's ``shape`` is given, else its
    chain."""
    if shape is not None:
        return source.tree(history, k, shape, mode, params, seed, max_support)
    return Tree.of_chain(*source.draft(history, k, mode, params, seed, max_support))


class OneDecision:
    """A source that decides a round's draft once (:meth:`_tree`), as a tree where the
    round has a shape and as a chain where it has none."""

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        tree = self._tree(history, k, None, mode, params, seed, max_support)
        return tree.tokens, tree.dists

    def tree(self, history: Sequence[int], k: int, shape: TreeShape, mode: Mode,
             params: SamplingParams, seed: int, max_support: int) -> Tree:
        return self._tree(history, k, shape, mode, params, seed, max_support)

    def _tree(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
              params: SamplingParams, seed: int, max_support: int) -> Tree:
        raise NotImplementedError


class HybridDraft(OneDecision):
    """Lookup where it matches (module docstring), the ``model`` elsewhere."""

    def __init__(self, model: DraftSource, lookup: Lookup,
                 min_match: int = HYBRID_MIN_MATCH, extend: bool = False) -> None:
        self.model, self.lookup = model, lookup
        self.min_match, self.extend = min_match, extend
        self._proposals = Proposals()

    @property
    def forced(self) -> int:
        return self.model.forced

    @property
    def looked_up(self) -> int:
        return self._proposals.count

    def forced_among(self, history: Sequence[int], tokens: Sequence[int]
                     ) -> tuple[int, ...]:
        return self.model.forced_among(history, tokens)

    def looked_up_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        return self._proposals.among(history, tokens)

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        """The lookup's draft where it matches (never extended by the model)."""
        looked = self._looked(history, k, shape, mode, params)
        if looked is not None:
            self._proposals.record(history, looked.trunk().tokens)
        return looked

    def _looked(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
                params: SamplingParams) -> Tree | None:
        looked = self.lookup.propose(history, k, shape, params.prompt_len)
        if self.lookup.match_len < self.min_match or not looked.tokens:
            return None
        return Tree(looked.tokens, looked.parents, reported(looked.tokens, mode, params),
                    looked.chain)

    def _tree(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
              params: SamplingParams, seed: int, max_support: int) -> Tree:
        looked = self._looked(history, k, shape, mode, params)
        if looked is None:
            tree = drafted(self.model, history, k, shape, mode, params, seed, max_support)
            self._proposals.record(history, tree.trunk().tokens, 0)
            return tree
        chain = looked.trunk().tokens
        more: tuple[int, ...] = ()
        dists = looked.dists
        if self.extend and len(chain) < k:
            more, more_dists = self.model.draft([*history, *chain], k - len(chain), mode,
                                                params, seed, max_support)
            if dists is not None:
                assert more_dists is not None
                dists = (*dists, *more_dists)
        self._proposals.record(history, (*chain, *more), len(chain))
        if not more:
            return looked
        last, n = looked.chain[-1], len(looked.tokens)
        return Tree((*looked.tokens, *more),
                    (*looked.parents, last, *range(n, n + len(more) - 1)), dists,
                    (*looked.chain, *range(n, n + len(more))))


class PredictedDraft(OneDecision):
    """A prediction of the output first, then the session's ``own`` source: each round the
    ``prediction``'s tokens from where the output stands in it, where the output starts or
    has followed it for ``min_run`` tokens since it picked it up again; ``own``'s draft
    elsewhere, and the prediction's where ``own`` proposes nothing. The prediction's tokens
    are reported one-hot, so verification stays lossless; :meth:`predicted_among` says which
    emitted tokens it proposed."""

    def __init__(self, prediction: PredictionLookup, own: DraftSource,
                 min_run: int = PREDICTION_MIN_RUN) -> None:
        self.prediction, self.own, self.min_run = prediction, own, min_run
        self._proposals = Proposals()  # the prediction's

    @property
    def forced(self) -> int:
        return self.own.forced

    @property
    def looked_up(self) -> int:
        return self._proposals.count + self.own.looked_up

    def forced_among(self, history: Sequence[int], tokens: Sequence[int]
                     ) -> tuple[int, ...]:
        return self.own.forced_among(history, tokens)

    def looked_up_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        return tuple(sorted({*self.predicted_among(history, tokens),
                             *self.own.looked_up_among(history, tokens)}))

    def predicted_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        """The indices of ``tokens`` (emitted after ``history``) the prediction proposed."""
        return self._proposals.among(history, tokens)

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        """The prediction's draft where the output follows it, else the session's own
        source's free draft."""
        tokens, first = self._predicted(history, k, params)
        if first:
            self._proposals.record(history, tokens)
            return Tree.of_chain(tokens, reported(tokens, mode, params))
        tree = self.own.free(history, k, shape, mode, params)
        if tree is not None:
            self._proposals.record(history, tree.trunk().tokens, 0)
        return tree

    def _predicted(self, history: Sequence[int], k: int, params: SamplingParams
                   ) -> tuple[tuple[int, ...], bool]:
        """The prediction's tokens after ``history``, and whether they draft first there."""
        tokens = self.prediction.propose(history, k, None, params.prompt_len).tokens
        first = self.prediction.match_len >= self.min_run or len(history) == params.prompt_len
        return tokens, bool(tokens) and first

    def _tree(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
              params: SamplingParams, seed: int, max_support: int) -> Tree:
        tokens, first = self._predicted(history, k, params)
        if first:
            self._proposals.record(history, tokens)
            return Tree.of_chain(tokens, reported(tokens, mode, params))
        tree = drafted(self.own, history, k, shape, mode, params, seed, max_support)
        if tree.tokens or not tokens:
            self._proposals.record(history, tree.trunk().tokens, 0)
            return tree
        self._proposals.record(history, tokens)  # the session's source has nothing
        return Tree.of_chain(tokens, reported(tokens, mode, params))


class DraftSources:
    """One edge session's draft sources, by kind, each made when first asked for.
    ``model``: the draft model's source (None: no draft model here)."""

    def __init__(self, model: DraftSource | None) -> None:
        self.model = model
        self._made: dict[tuple[DraftKind, bool], DraftSource] = {}

    def get(self, kind: DraftKind, memory: bool = False) -> DraftSource:
        """The source of ``kind`` (:meth:`~spececd.edge.options.DraftKind.where` this
        session is); ``memory``: suffix drafting (the hybrid's lookup too) that also draws on
        this session's earlier generations."""
        kind = kind.where(self.model is not None)
        memory = memory and kind in (DraftKind.SUFFIX, DraftKind.HYBRID)
        made = self._made.get((kind, memory))
        if made is not None:
            return made
        if kind is DraftKind.LOOKUP:
            made = NgramLookup()
        elif kind is DraftKind.SUFFIX:
            made = SuffixDraft(memory=memory)
        else:
            assert self.model is not None  # where() said so
            # The hybrid looks up by prompt lookup (the cheaper of two equal chains), or with
            # a suffix trie where it is to remember earlier generations.
            made = self.model if kind is DraftKind.MODEL else HybridDraft(
                self.model, SuffixDraft(memory=True) if memory
                else NgramLookup(max_ngram=HYBRID_MIN_MATCH))
        self._made[(kind, memory)] = made
        return made
