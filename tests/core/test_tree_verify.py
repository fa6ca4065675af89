"""Verification of token trees: exact cases, then chi-square proof that it is lossless.

The statistical tests reuse the toy Markov models of ``test_verify``: a drafter builds a
tree (several children at every level, one of them extended), the verifier walks it, and
the first two emitted tokens, over 20,000 draws, must follow the target's own joint
distribution. Adversarial trees are in the list: duplicate children, children the target
never emits, children sampled with and without replacement. Planted tree bugs must fail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from spececd.core.params import Mode, SamplingParams
from spececd.core.sampling import SparseProbs, sample
from spececd.core.verify import VerifyResult, check_tree, tree_paths, verify
from tests.core.test_verify import (
    DRAWS,
    Setting,
    V,
    draft_table,
    one_hot,
    pairs_p_value,
    point,
    target_table,
)

# -- exact cases --------------------------------------------------------------------


def test_a_chain_is_the_tree_of_single_children() -> None:
    target = one_hot([1, 2, 4, 4])
    for rng_seed in range(3):
        chain = verify([1, 2, 3], target, np.random.default_rng(rng_seed), Mode.MATCH)
        tree = verify([1, 2, 3], target, np.random.default_rng(rng_seed), Mode.MATCH,
                      parents=[-1, 0, 1])
        assert (chain.num_accepted, chain.next_token) == (tree.num_accepted, tree.next_token)
        assert tree.path == (0, 1)


@pytest.mark.parametrize("mode", [Mode.MATCH, Mode.GREEDY, Mode.EXACT])
def test_the_verifier_follows_the_child_the_target_picks(mode: Mode) -> None:
    # Root children 3 (node 0) and 1 (node 1); node 1 has children 4 (node 2), 2 (node 3).
    tokens, parents = [3, 1, 4, 2], [-1, -1, 1, 1]
    target = one_hot([1, 0, 2, 0, 4])  # rows: root, node 0, node 1, node 2, node 3
    dists = [point(3), SparseProbs(np.array([1, 3]), np.array([0.5, 0.5], np.float32)),
             point(4), SparseProbs(np.array([2, 4]), np.array([0.5, 0.5], np.float32))]
    result = verify(tokens, target, np.random.default_rng(0), mode, dists, parents=parents)
    assert result == VerifyResult(2, 4, (1, 3))  # tokens 1, 2, then the bonus after node 3


def test_no_matching_child_emits_the_targets_token() -> None:
    target = one_hot([2, 0, 0, 0])
    result = verify([3, 4, 1], target, np.random.default_rng(0), Mode.GREEDY,
                    parents=[-1, -1, 0])
    assert result == VerifyResult(0, 2, ())


def test_duplicate_children_are_harmless_in_match_mode() -> None:
    target = one_hot([4, 1, 1, 3])
    result = verify([4, 4, 2], target, np.random.default_rng(0), Mode.MATCH,
                    parents=[-1, -1, 1])
    assert result == VerifyResult(1, 1, (0,))  # the first equal child is followed


def test_trees_are_checked() -> None:
    with pytest.raises(ValueError, match="earlier node"):
        check_tree([-1, 1], 2)
    with pytest.raises(ValueError, match="needs 3 parents"):
        verify([1, 2, 3], one_hot([1, 2, 3, 4]), np.random.default_rng(0), Mode.MATCH,
               parents=[-1, 0])
    assert tree_paths([-1, -1, 1, 2]) == [(0,), (1,), (1, 2), (1, 2, 3)]


# -- statistical tests ----------------------------------------------------------------

DEPTH, WIDTH = 2, 3


@dataclass(frozen=True)
class TreeSetting:
    name: str
    setting: Setting
    siblings: str = "without"  # without | with (replacement) | top | duplicate


TREES = [
    TreeSetting("exact T=1 without replacement", Setting("", SamplingParams(1.0))),
    TreeSetting("exact T=1 with replacement", Setting("", SamplingParams(1.0)), "with"),
    TreeSetting("exact top-k=3, uniform draft (children outside the support)",
                Setting("", SamplingParams(1.0, top_k=3), draft="uniform")),
    TreeSetting("exact one-hot wrong draft, duplicate children",
                Setting("", SamplingParams(1.0), draft="onehot_wrong"), "with"),
    TreeSetting("exact top-p=0.8 without replacement", Setting("", SamplingParams(1.0, top_p=0.8))),
    TreeSetting("match T=1 top children", Setting("", SamplingParams(1.0), mode=Mode.MATCH),
                "top"),
    TreeSetting("match T=0.9 duplicate children",
                Setting("", SamplingParams(0.9), mode=Mode.MATCH), "duplicate"),
    TreeSetting("match top-k=3, uniform draft", Setting("", SamplingParams(1.0, top_k=3),
                                                         draft="uniform", mode=Mode.MATCH),
                "with"),
]

TreeVerifyFn = Callable[..., VerifyResult]


def without(dist: SparseProbs, token: int) -> SparseProbs:
    """``dist`` with ``token`` removed and renormalised (sampling without replacement)."""
    keep = dist.ids != token
    probs = dist.normalized()[keep]
    return SparseProbs(dist.ids[keep], (probs / probs.sum()).astype(np.float32))


def draft_children(q: SparseProbs, how: str, rng: np.random.Generator
                   ) -> list[tuple[int, SparseProbs]]:
    """WIDTH children of a node whose draft distribution is ``q``, each with the
    distribution it was drawn from."""
    children: list[tuple[int, SparseProbs]] = []
    if how == "top":  # deterministic: match mode needs no distribution
        order = q.ids[np.argsort(-q.normalized(), kind="stable")]
        return [(int(t), q) for t in order[:WIDTH]]
    if how == "duplicate":
        token = int(q.ids[sample(q.normalized(), rng)])
        return [(token, q), (token, q), (int(q.ids[sample(q.normalized(), rng)]), q)]
    current = q
    for _ in range(WIDTH):
        if current.ids.size == 0:
            break
        token = int(current.ids[sample(current.normalized(), rng)])
        children.append((token, current))
        if how == "without" and current.ids.size > 1:
            current = without(current, token)
        elif how == "without":
            break
    return children


def simulate_tree(tree: TreeSetting, verify_fn: TreeVerifyFn = verify, seed: int = 0,
                  report: Callable[[SparseProbs, SparseProbs], SparseProbs] | None = None
                  ) -> np.ndarray:
    """DRAWS generations of two tokens after the prompt [0], each a tree of DEPTH levels
    whose first child at each level is extended; returns the pairs as ``a * V + b``.
    ``report(original, drawn_from)``: the distribution the drafter reports for a child."""
    setting = tree.setting
    target, drafts = target_table(setting.params), draft_table(setting)
    draft_rng, verify_rng = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    pairs = np.empty(DRAWS, dtype=np.int64)
    for d in range(DRAWS):
        history: list[int] = [0]
        out: list[int] = []
        while len(out) < 2:
            tokens: list[int] = []
            parents: list[int] = []
            dists: list[SparseProbs] = []
            parent, previous = -1, history[-1]
            for _ in range(DEPTH):
                children = draft_children(drafts[previous], tree.siblings, draft_rng)
                first = len(tokens)
                for token, dist in children:
                    tokens.append(token)
                    parents.append(parent)
                    dists.append(report(drafts[previous], dist) if report else dist)
                parent, previous = first, tokens[first]
            rows = [history[-1], *tokens]
            result = verify_fn(tokens, target[rows], verify_rng, setting.mode, dists,
                               parents=parents)
            assert result.path is not None
            emitted = [*(tokens[i] for i in result.path), result.next_token]
            out.extend(emitted)
            history.extend(emitted)
        pairs[d] = out[0] * V + out[1]
    return pairs


@pytest.mark.parametrize("tree", TREES, ids=[t.name for t in TREES])
def test_tree_output_follows_the_target_distribution(tree: TreeSetting) -> None:
    p_value = pairs_p_value(simulate_tree(tree), tree.setting.params)
    print(f"{tree.name}: chi-square p={p_value:.4f}")
    assert p_value > 0.001


def test_greedy_trees_emit_the_targets_argmax_chain() -> None:
    target = target_table(SamplingParams(temperature=0.0))
    expected, token = [], 0
    for _ in range(6):
        token = int(np.argmax(target[token]))
        expected.append(token)
    drafts = draft_table(Setting("", SamplingParams(1.0)))
    rng = np.random.default_rng(5)
    history: list[int] = [0]
    while len(history) < 7:
        tokens, parents = [], []
        parent, previous = -1, history[-1]
        for _ in range(DEPTH):
            first = len(tokens)
            for token, _ in draft_children(drafts[previous], "top", rng):
                tokens.append(token)
                parents.append(parent)
            parent, previous = first, tokens[first]
        rows = [history[-1], *tokens]
        result = verify(tokens, target[rows], rng, Mode.GREEDY, parents=parents)
        assert result.path is not None
        history.extend([*(tokens[i] for i in result.path), result.next_token])
    assert history[1:7] == expected


# Planted tree bugs.

def verify_siblings_share_the_target(draft_tokens: Sequence[int], target_probs: np.ndarray,
                                     rng: np.random.Generator, mode: Mode,
                                     draft_probs: Sequence[SparseProbs],
                                     parents: Sequence[int]) -> VerifyResult:
    """Each sibling tested against the node's full target distribution (no residual
    between siblings), the correction from the last residual."""
    path: list[int] = []
    row = 0
    while True:
        children = [i for i, p in enumerate(parents) if p == row - 1]
        probs = target_probs[row]
        for child in children:
            token, dist = draft_tokens[child], draft_probs[child]
            if rng.random() < min(1.0, target_probs[row, token] / dist.prob_of(token)):
                path.append(child)
                row = child + 1
                break
            residual = np.maximum(probs - dist.dense(V), 0)
            probs = residual / residual.sum() if residual.sum() > 0 else probs
        else:
            return VerifyResult(len(path), sample(probs, rng), tuple(path))


def test_planted_tree_bugs_fail_the_test() -> None:
    tree = TREES[0]
    p_value = pairs_p_value(simulate_tree(tree, verify_siblings_share_the_target),
                            tree.setting.params)
    print(f"planted bug shared target: chi-square p={p_value:.3g}")
    assert p_value < 0.001
    # Siblings drawn without replacement, each reported with the undiminished distribution.
    p_value = pairs_p_value(simulate_tree(tree, report=lambda original, _: original),
                            tree.setting.params)
    print(f"planted bug undiminished q: chi-square p={p_value:.3g}")
    assert p_value < 0.001
