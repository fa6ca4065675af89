"""The drafter's trees: the chain is the one a width-1 draft gives, siblings are where the
draft is unsure, and in exact mode each sibling is a draw its reported distribution could
have made (without replacement), in the budget asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from spececd.backends.registry import load_backend
from spececd.core.sampling import Mode, SamplingParams
from spececd.edge.drafter import Drafter

HISTORY = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def drafter(tiny_models: dict[str, Path]) -> Drafter:
    return Drafter(load_backend(str(tiny_models["draft"]), device="cpu", dtype="float32"))


@pytest.mark.parametrize("mode,temperature", [(Mode.GREEDY, 0.0), (Mode.MATCH, 1.0),
                                              (Mode.EXACT, 1.0)])
def test_a_trees_chain_is_the_width_1_draft(drafter: Drafter, mode: Mode,
                                            temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=7)
    chain, chain_dists = drafter.draft(HISTORY, 5, mode, params, 7, 16)
    tree = drafter.tree(HISTORY, 5, 3, 15, mode, params, 7, 16)
    assert tuple(tree.tokens[i] for i in tree.chain) == chain
    assert tree.branched  # a random-init draft is unsure everywhere
    assert len(tree.tokens) <= 15
    for depth, node in enumerate(tree.chain):  # each level hangs off the chain before it
        assert tree.parents[node] == (tree.chain[depth - 1] if depth else -1)
    if chain_dists is not None:
        assert tree.dists is not None
        assert all(np.array_equal(tree.dists[i].ids, d.ids)
                   for i, d in zip(tree.chain, chain_dists, strict=True))


def test_exact_siblings_are_distinct_draws_from_what_is_left(drafter: Drafter) -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    tree = drafter.tree(HISTORY, 4, 4, 16, Mode.EXACT, params, 3, 16)
    assert tree.dists is not None
    for parent in {-1, *tree.chain}:
        children = [i for i, p in enumerate(tree.parents) if p == parent]
        tokens = [tree.tokens[i] for i in children]
        assert len(set(tokens)) == len(tokens)  # without replacement
        for j, child in enumerate(children):
            dist = tree.dists[child]
            assert dist.prob_of(tree.tokens[child]) > 0
            assert not set(tokens[:j]) & set(dist.ids.tolist())  # earlier siblings removed


def test_the_budget_keeps_room_for_the_chain(drafter: Drafter) -> None:
    params = SamplingParams(temperature=0.0, seed=1)
    tree = drafter.tree(HISTORY, 6, 4, 8, Mode.GREEDY, params, 1, 16)
    assert len(tree.chain) == 6 and len(tree.tokens) == 8
