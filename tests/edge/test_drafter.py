"""The drafter's trees: the chain is the one a width-1 draft gives, siblings are where the
draft is unsure, and in exact mode each sibling is a draw its reported distribution could
have made (without replacement), in the budget asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from spececd.backends.registry import load_backend
from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import DraftLengthPolicy, TreeShape
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
    tree = drafter.tree(HISTORY, 5, TreeShape(3, 15, (1.0,) * 5, 0.0), mode, params, 7, 16)
    assert tuple(tree.tokens[i] for i in tree.chain) == chain
    assert tree.branched  # a random-init draft is unsure everywhere
    assert len(tree.tokens) <= 15
    for depth, node in enumerate(tree.chain):  # each level hangs off the chain before it
        assert tree.parents[node] == (tree.chain[depth - 1] if depth else -1)
    # Off the chain, leaves: a stream-drafting hint's alternatives, by chain position.
    siblings = tree.siblings()
    assert len(siblings) == len(tree.tokens) - len(tree.chain)
    for i, token in siblings:
        assert any(tree.tokens[j] == token and tree.parents[j] == tree.parents[tree.chain[i]]
                   for j in range(len(tree.tokens)) if j not in tree.chain)
    assert {tree.parents[j] for j in range(len(tree.tokens))} <= {-1, *tree.chain}
    if chain_dists is not None:
        assert tree.dists is not None
        assert all(np.array_equal(tree.dists[i].ids, d.ids)
                   for i, d in zip(tree.chain, chain_dists, strict=True))


def test_exact_siblings_are_distinct_draws_from_what_is_left(drafter: Drafter) -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    tree = drafter.tree(HISTORY, 4, TreeShape(4, 16, (1.0,) * 4, 0.0), Mode.EXACT, params, 3,
                        16)
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
    tree = drafter.tree(HISTORY, 6, TreeShape(4, 8, (1.0,) * 6, 0.0), Mode.GREEDY, params, 1,
                        16)
    assert len(tree.chain) == 6 and len(tree.tokens) == 8


@pytest.mark.parametrize("mode,temperature", [(Mode.GREEDY, 0.0), (Mode.EXACT, 1.0)])
def test_siblings_must_be_worth_their_position(drafter: Drafter, mode: Mode,
                                               temperature: float) -> None:
    """A sibling at depth i is sent when reach[i] times its draft probability (exact: the
    mass left) reaches the floor; the tiny draft's probabilities are all below 0.05."""
    params = SamplingParams(temperature=temperature, seed=2)
    shallow = drafter.tree(HISTORY, 4, TreeShape(3, 12, (1.0, 1.0, 0.0, 0.0), 0.001), mode,
                           params, 2, 512)
    assert {shallow.parents[i] for i in range(len(shallow.tokens)) if i not in shallow.chain} \
        <= {-1, shallow.chain[0]}  # no sibling where the round is not reached
    assert shallow.branched
    assert not drafter.tree(HISTORY, 4, TreeShape(3, 12, (1.0,) * 4, 1.01), mode, params, 2,
                            512).branched  # nothing is worth more than a whole token


def test_the_floor_falls_as_the_round_trip_grows() -> None:
    """Delay-aware shape: the same acceptance and verify costs, a longer round trip, so
    fewer tokens per second from rounds and a lower bar for a sibling."""
    floors = []
    for network_s in (0.0, 0.02, 0.1):
        policy = DraftLengthPolicy(k_max=8)
        for _ in range(20):
            policy.observe(4, 2, 0.004, 0.01, network_s, positions=4)
            policy.observe(1, 1, 0.001, 0.006, network_s, positions=1)
        floors.append(policy.tree_shape(4, 3, 12).floor)
    assert floors[0] > floors[1] > floors[2] > 0
