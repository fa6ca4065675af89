"""Drafts without a model (:mod:`spececd.edge.lookup`) and the hybrid source
(:mod:`spececd.edge.sources`): exact cases, the suffix trie against a fresh build, and the
statistical proof that looked-up drafts, reported one-hot, keep the target's distribution
through the real verification pass, with a planted bug (a looked-up draft reported with a
distribution that is not one-hot) that the same test catches."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import TreeShape
from spececd.core.sampling import SparseProbs, process_logits
from spececd.edge import lookup
from spececd.edge.drafter import Drafter, DraftSource
from spececd.edge.lookup import NgramLookup, SuffixDraft, SuffixTrie
from spececd.edge.options import DraftKind, EdgeOptions, Site
from spececd.edge.sources import DraftSources, HybridDraft
from spececd.errors import InputError
from tests.chisq import chi_square_p
from tests.rounds import generate
from tests.toy import ToyBackend, toy_pair

SAMPLED = SamplingParams(temperature=1.0)
WIDE = TreeShape(width=3, budget=12, reach=(1.0,) * 8, floor=0.1)


# -- n-gram lookup ----------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_longest_recent_suffix() -> None:
    source = NgramLookup(max_ngram=3, min_ngram=2)
    # [2, 3] occurred twice; [1, 2, 3] only at the start: the longer match wins.
    assert source.propose([1, 2, 3, 4, 5, 8, 2, 3, 6, 1, 2, 3], 3).tokens == (4, 5, 8)
    assert source.match_len == 3
    # Equally long matches: the most recent one.
    assert source.propose([7, 1, 2, 9, 1, 2, 8, 0, 1, 2], 2).tokens == (8, 0)
    assert source.match_len == 2
    # A suffix of one token is too short to be worth a verified position.
    assert source.propose([5, 6, 7, 5], 4).tokens == ()
    assert source.match_len == 0
    assert source.propose([], 4).tokens == ()


def test_a_repeating_pattern_is_continued_past_the_text() -> None:
    assert NgramLookup().propose([7, 8, 7, 8, 7, 8], 5).tokens == (7, 8, 7, 8, 7)


def test_looked_up_drafts_are_reported_one_hot_where_the_verifier_needs_them() -> None:
    source = NgramLookup()
    history = [1, 2, 3, 1, 2]
    tokens, dists = source.draft(history, 2, Mode.EXACT, SAMPLED, 0, 8)
    assert tokens == (3, 1)
    assert dists is not None
    assert [(d.ids.tolist(), d.normalized().tolist()) for d in dists] == [([3], [1.0]),
                                                                          ([1], [1.0])]
    for mode, params in ((Mode.MATCH, SAMPLED), (Mode.EXACT, SamplingParams(temperature=0))):
        assert source.draft(history, 2, mode, params, 0, 8)[1] is None


def test_a_source_says_which_emitted_tokens_it_looked_up() -> None:
    source = NgramLookup()
    history = [1, 2, 3, 4, 1, 2]
    source.draft(history, 2, Mode.MATCH, SAMPLED, 0, 8)  # proposes 3, 4
    assert source.looked_up == 2
    assert source.looked_up_among(history, [3, 9]) == (0,)  # 9: the verifier's own
    assert source.looked_up_among(history, [3, 4, 5]) == (0, 1)
    assert source.looked_up_among([1, 2], [3]) == ()  # another history


# -- the suffix trie ----------------------------------------------------------------------


def _counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}

    def walk(node: object, path: tuple[int, ...]) -> None:
        for token, child in node.children.items():  # type: ignore[attr-defined]
            out[(*path, token)] = child.count
            walk(child, (*path, token))

    walk(trie.root, ())
    return out


def _stretches(text: Sequence[int], depth: int) -> Counter[tuple[int, ...]]:
    """The reference: every stretch of 1 to ``depth`` tokens of ``text``, counted."""
    return Counter(tuple(text[i:j]) for i in range(len(text))
                   for j in range(i + 1, min(len(text), i + depth) + 1))


def test_the_trie_follows_a_history_that_grows_and_rolls_back() -> None:
    rng = random.Random(3)
    trie, text = SuffixTrie(depth=5), []
    for _ in range(300):
        if text and rng.random() < 0.3:
            text = text[:rng.randrange(len(text))]  # a rollback
        text = text + [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        trie.sync(text)
        assert trie.tokens == text
    assert _counts(trie) == dict(_stretches(text, 5))


def test_suffix_drafting_follows_the_most_frequent_continuation_and_branches() -> None:
    history = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    source = SuffixDraft()
    chain = source.propose(history, 4)
    assert chain.tokens == (4, 1, 2, 3) and not chain.branched  # ties: the smaller token
    assert source.match_len == 3
    tree = source.propose(history, 4, WIDE)
    # after [1, 2, 3]: 4 (twice), 5 (once); after [1, 2, 3, 4]: 1, 6 (once each; 1 first)
    assert tree.trunk().tokens == (4, 1, 2, 3)
    assert tree.siblings() == ((0, 5), (1, 6))
    dists = source.tree(history, 4, WIDE, Mode.EXACT, SAMPLED, 0, 8).dists
    assert dists is not None and len(dists) == len(tree.tokens)
    assert all(d.ids.size == 1 for d in dists)


def test_suffix_drafting_remembers_earlier_generations() -> None:
    source = SuffixDraft(memory=True)
    first = [5, 6, 7, 10, 11, 12, 13, 14]  # a prompt of 3, then a generation
    source.draft(first, 4, Mode.MATCH, SamplingParams(prompt_len=3), 0, 8)
    again = [8, 9, 7, 10, 11]  # another prompt: the first generation is in memory
    tokens, _ = source.draft(again, 4, Mode.MATCH, SamplingParams(prompt_len=3), 0, 8)
    assert tokens == (12, 13, 14)  # and no further: nothing followed it
    forgetful = SuffixDraft()  # the default
    forgetful.draft(first, 4, Mode.MATCH, SamplingParams(prompt_len=3), 0, 8)
    assert forgetful.draft(again, 4, Mode.MATCH, SamplingParams(prompt_len=3), 0, 8)[0] == ()


# -- the hybrid ---------------------------------------------------------------------------


def test_the_hybrid_looks_up_where_the_match_is_long_and_asks_the_model_elsewhere() -> None:
    draft, _ = toy_pair(agreement=0.5)
    model = Drafter(draft)
    hybrid = HybridDraft(model, NgramLookup(), min_match=3)
    repeated = [40, 41, 42, 43, 44, 45, 9, 40, 41, 42]
    tokens, _ = hybrid.draft(repeated, 3, Mode.MATCH, SAMPLED, 0, 8)
    assert tokens == (43, 44, 45) and hybrid.looked_up == 3
    assert model.sequence.tokens == []  # the model never ran
    assert hybrid.looked_up_among(repeated, [43, 44]) == (0, 1)
    fresh = [40, 41, 42, 43, 44, 45, 9, 42]  # a match of one token: the model drafts
    tokens, _ = hybrid.draft(fresh, 3, Mode.MATCH, SAMPLED, 0, 8)
    assert tokens == Drafter(draft).draft(fresh, 3, Mode.MATCH, SAMPLED, 0, 8)[0]
    assert hybrid.looked_up == 3
    assert hybrid.looked_up_among(fresh, tokens) == ()


def test_an_extending_hybrid_leaves_a_lookup_that_fills_the_round_alone() -> None:
    draft, _ = toy_pair(agreement=0.5)
    model = Drafter(draft)
    hybrid = HybridDraft(model, NgramLookup(max_ngram=2), min_match=2, extend=True)
    history = [3, 4, 5, 6, 3, 4]  # a repeating pattern: the lookup runs on to any length
    tokens, dists = hybrid.draft(history, 6, Mode.EXACT, SAMPLED, 0, 8)
    assert tokens == (5, 6, 3, 4, 5, 6) and dists is not None
    assert model.sequence.tokens == []  # the model never ran


def lookup_of(limit: int) -> NgramLookup:
    """A lookup that proposes at most ``limit`` tokens, whatever ``k`` asks."""

    class Short(NgramLookup):
        def propose(self, history: Sequence[int], k: int, shape: TreeShape | None = None,
                    prompt_len: int = 0) -> lookup.Tree:
            return super().propose(history, min(k, limit), shape, prompt_len)

    return Short()


def test_an_extended_lookup_reports_the_models_distributions_after_its_own() -> None:
    draft, _ = toy_pair(agreement=0.5)
    hybrid = HybridDraft(Drafter(draft), lookup_of(2), min_match=2, extend=True)
    history = [30, 31, 32, 9, 30, 31]
    tokens, dists = hybrid.draft(history, 4, Mode.EXACT, SAMPLED, 0, 8)
    assert tokens[:2] == (32, 9) and len(tokens) == 4 and dists is not None
    assert [d.ids.size for d in dists[:2]] == [1, 1]  # looked up: one-hot
    assert dists[2].ids.size > 1  # the model's own
    assert hybrid.looked_up_among(history, tokens) == (0, 1)


def test_draft_kinds_resolve_by_what_is_loaded() -> None:
    with_model, without = Site(in_process=False), Site(in_process=False, draft_model=False)
    assert EdgeOptions().resolved(with_model).draft_source is DraftKind.HYBRID
    assert EdgeOptions().resolved(without).draft_source is DraftKind.LOOKUP
    lookup_only = EdgeOptions().with_settings(draft_source="lookup")
    assert lookup_only.resolved(without).draft_source is DraftKind.LOOKUP
    for needs in ("model", "hybrid"):
        with pytest.raises(InputError, match="needs a draft model"):
            EdgeOptions().with_settings(draft_source=needs).resolved(without)
    with pytest.raises(InputError, match="draft-source must be one of"):
        EdgeOptions().with_settings(draft_source="oracle")
    sources = DraftSources(None)
    assert isinstance(sources.get(DraftKind.AUTO), NgramLookup)
    assert isinstance(sources.get(DraftKind.SUFFIX), SuffixDraft)
    assert sources.get(DraftKind.SUFFIX) is sources.get(DraftKind.SUFFIX)  # kept
    remembering = sources.get(DraftKind.SUFFIX, memory=True)
    assert isinstance(remembering, SuffixDraft) and remembering.memory is not None
    assert sources.get(DraftKind.LOOKUP, memory=True) is sources.get(DraftKind.LOOKUP)
    with pytest.raises(InputError, match="needs a draft model"):
        sources.get(DraftKind.HYBRID)


# -- lossless -------------------------------------------------------------------------------

DRAWS = 3000
TOP_K = 4


def copying_prompt(target: ToyBackend) -> list[int]:
    """A prompt whose last two tokens occurred earlier, followed there by the target's most
    likely token after the prompt: a lookup proposes it, and the verifier often keeps it."""
    head, tail = [10, 11, 12], [20, 21, 22, 23]
    prompt = [*head, 0, *tail, *head[1:]]
    likely = int(np.argmax(target.model.forward(prompt)[-1]))
    return [*head, likely, *tail, *head[1:]]


def pair_distribution(target: ToyBackend, prompt: list[int], params: SamplingParams
                      ) -> dict[tuple[int, int], float]:
    """P(the target alone writes each two tokens after ``prompt``), by fresh passes."""
    first = process_logits(target.model.forward(prompt)[-1:], params)[0]
    out = {}
    for a in np.flatnonzero(first):
        second = process_logits(target.model.forward([*prompt, int(a)])[-1:], params)[0]
        for b in np.flatnonzero(second):
            out[(int(a), int(b))] = float(first[a] * second[b])
    return out


def sampled_pairs(source: DraftSource, target: ToyBackend, prompt: list[int], mode: Mode
                  ) -> Counter[tuple[int, int]]:
    outputs: Counter[tuple[int, int]] = Counter()
    for seed in range(DRAWS):
        # Three tokens, so that a round drafts two: the first two are compared.
        params = SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=3,
                                prompt_len=len(prompt))
        out = generate(source, target, None, prompt, params, mode, k=3)
        outputs[(out[0], out[1])] += 1
    return outputs


def p_value(outputs: Counter[tuple[int, int]], expected: dict[tuple[int, int], float]) -> float:
    cells = sorted(set(expected) | set(outputs))
    observed = np.array([outputs[c] for c in cells], dtype=float)
    return chi_square_p(observed, np.array([expected.get(c, 0.0) for c in cells]) * DRAWS)


class BiasedLookup(NgramLookup):
    """The planted bug: looked-up drafts reported as if drawn from a distribution that
    gives them only half their mass, when they were certain."""

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        tokens, dists = super().draft(history, k, mode, params, seed, max_support)
        if dists is None:
            return tokens, None
        return tokens, halved(tokens)


def halved(tokens: Sequence[int]) -> tuple[SparseProbs, ...]:
    """Certain drafts misreported: each token with half the mass, its neighbour the rest."""
    return tuple(SparseProbs(np.array([t, (t + 1) % 256]),
                             np.array([0.5, 0.5], dtype=np.float32)) for t in tokens)


@pytest.mark.parametrize("kind", ["lookup", "suffix", "hybrid"])
@pytest.mark.parametrize("mode", [Mode.EXACT, Mode.MATCH])
def test_looked_up_drafts_keep_the_target_distribution(kind: str, mode: Mode) -> None:
    draft, target = toy_pair(agreement=0.5)
    prompt = copying_prompt(target)
    source: DraftSource = {"lookup": NgramLookup(), "suffix": SuffixDraft(memory=True),
                           "hybrid": HybridDraft(Drafter(draft), NgramLookup(), 2)}[kind]
    outputs = sampled_pairs(source, target, prompt, mode)
    assert source.looked_up >= DRAWS  # the lookup proposed in every generation
    expected = pair_distribution(target, prompt, SamplingParams(temperature=1.0, top_k=TOP_K))
    assert p_value(outputs, expected) > 0.001


def test_a_looked_up_draft_reported_with_another_distribution_is_caught() -> None:
    _, target = toy_pair(agreement=0.5)
    prompt = copying_prompt(target)
    outputs = sampled_pairs(BiasedLookup(), target, prompt, Mode.EXACT)
    expected = pair_distribution(target, prompt, SamplingParams(temperature=1.0, top_k=TOP_K))
    assert p_value(outputs, expected) < 0.001
