"""The token budget per pass (:mod:`spececd.core.budget`): the planner's choices, the pass
cost fit, cutting a draft to a leading prefix, and statistical proof that a cut chosen
before the pass is lossless while one chosen from the pass's outcome is not.

The statistical tests reuse the verification tests' toy Markov models and loop
(:func:`tests.core.test_verify.simulate`): 20,000 draws of the first two emitted tokens
against the target's own distribution, by chi-square."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from spececd.core.budget import (
    AMORTISE,
    HEADROOM,
    MIN_CHUNK,
    START_BUDGET,
    DepthAcceptance,
    Offer,
    PassCost,
    cut_draft,
    pass_budget,
    plan,
    tree_nodes,
)
from spececd.core.params import Mode
from spececd.core.sampling import SparseProbs, sample_sparse
from spececd.core.verify import VerifyResult, verify
from tests.chisq import chi_square_p
from tests.core.test_verify import SETTINGS, VerifyFn, pairs_p_value, simulate


def decoding(worth: Sequence[float]) -> Offer:
    return Offer(0, tuple(worth), tree_nodes(None, len(worth)))


def test_a_pass_that_fits_or_holds_one_session_runs_whole() -> None:
    offers = [decoding([0.9, 0.8, 0.1]), Offer(50, (0.5,), (1,))]
    assert plan(offers, 56).depths == (3, 1)  # 3 + 1 + 50 + 1 + 1 positions fit
    assert plan(offers, 55).depths == (3, None)
    assert plan(offers, None).depths == (3, 1)
    lone = plan([Offer(500, (0.2,) * 8, tree_nodes(None, 8))], 16)
    assert lone.depths == (8,) and lone.chunks == (0,) and lone.level == 0


def test_drafts_are_cut_by_worth_and_every_session_gets_its_token() -> None:
    offers = [decoding([0.9, 0.8, 0.7, 0.1]), decoding([0.5, 0.2]), decoding([])]
    chosen = plan(offers, 3 + 4)  # three tokens, four drafted positions
    assert chosen.depths == (3, 1, 0)  # 0.9, 0.8, 0.7, 0.5 beat 0.2 and 0.1
    assert chosen.chunks == (0, 0, 0)
    assert chosen.level == pytest.approx(0.5)  # the least worth verified
    assert plan(offers, 2).depths == (0, 0, 0)  # below the tokens: the tokens still go
    assert plan(offers, 2).level > 0.9  # nothing verified: every session is told none


def test_the_level_is_the_least_worth_verified_when_a_tree_does_not_fit() -> None:
    """A tree whose first depth (12 nodes) does not fit is skipped; the chain's three
    positions are verified, so a session like it is told its three positions (a level
    taken from the skipped tree's worth, 0.9, told it none)."""
    tree, chain = Offer(0, (0.9, 0.85), (12, 13)), decoding([0.8, 0.7, 0.6])
    chosen = plan([tree, chain], 2 + 6)
    assert chosen.depths == (0, 3)
    assert chosen.level == pytest.approx(0.6)
    session = DepthAcceptance()
    for _ in range(200):
        session.observe(3, 3)
    assert session.budget(chosen.level, 64) >= 3


def test_drafts_stop_where_a_position_no_longer_pays() -> None:
    cost = PassCost()
    for rows, positions in ((1, 1), (2, 10), (4, 4), (8, 40), (3, 30), (6, 6), (2, 2), (5, 9)):
        cost.update(rows, positions, 0.010 + 0.001 * positions)  # 1 ms a position
    # Tokens per second so far: 2 tokens in 12 ms, so a position must bring 2/12 of a token.
    offers = [decoding([0.9, 0.5, 0.15, 0.1]), decoding([0.6, 0.12])]
    assert plan(offers, 7, cost).depths == (2, 1)
    assert plan(offers, 7).depths == (3, 2)  # without the cost, the budget alone decides


def test_prompts_fill_the_rest_in_chunks_and_always_move() -> None:
    offers = [decoding([0.9] * 4), decoding([0.9] * 4), Offer(300, (), ()),
              Offer(200, (0.5,), (1,))]
    chosen = plan(offers, 64)
    assert chosen.depths[:2] == (4, 4) and chosen.depths[2:] == (None, None)
    assert chosen.chunks == (0, 0, 54, 0)  # first come, first served: the rest of 64
    # Drafts that could take everything leave a prompt its share.
    crowded = [decoding([0.99] * 60), Offer(300, (), ())]
    squeezed = plan(crowded, 64)
    assert squeezed.chunks[1] >= MIN_CHUNK and squeezed.positions(crowded) <= 64 + MIN_CHUNK


def test_no_session_is_starved() -> None:
    """Pass after pass under a tight budget: every decoding session gets its token in every
    pass, and every prompt is in after finitely many."""
    rng = np.random.default_rng(1)
    prompts = {i: int(rng.integers(50, 400)) for i in range(6)}  # joining: tokens left
    passes = 0
    while prompts:
        offers = [decoding([0.95] * 8) for _ in range(20)]
        offers += [Offer(left, (0.9,) * 4, tree_nodes(None, 4)) for left in prompts.values()]
        chosen = plan(offers, 40)
        assert all(depth is not None for depth in chosen.depths[:20])
        for key, depth, chunk in zip(list(prompts), chosen.depths[20:], chosen.chunks[20:],
                                     strict=True):
            if depth is not None:
                del prompts[key]
            else:
                prompts[key] -= chunk
        passes += 1
        assert passes < 300
    print(f"6 prompts in beside 20 decoding sessions after {passes} passes")


def test_the_pass_cost_fit_recovers_rows_and_positions() -> None:
    cost = PassCost()
    rng = np.random.default_rng(0)
    for _ in range(40):
        rows, positions = int(rng.integers(1, 64)), int(rng.integers(1, 600))
        cost.update(rows, positions, 0.004 + 0.002 * rows + 0.0005 * positions)
    assert cost.fitted
    assert cost.per_position == pytest.approx(0.0005, rel=1e-3)
    assert cost.predict(10, 100) == pytest.approx(0.004 + 0.02 + 0.05, rel=1e-3)
    assert cost.positions_within(10, 0.07425) == 100  # 100.5 positions fit: 100
    # A device full of rows: a pass may take HEADROOM times their tokens alone.
    assert cost.budget(64, 0.01) == cost.positions_within(64, HEADROOM * cost.predict(64, 64))
    assert cost.error < 1e-3  # the costs are the fit's own line
    flat = PassCost()
    for rows in range(1, 10):
        flat.update(rows, 5 * rows, 0.01)  # positions cost nothing: no budget
    assert flat.per_position == 0 and flat.budget(9, 0.005) is None


def test_the_pass_cost_fit_charges_the_context_the_rows_read() -> None:
    """Decode attention and the reads of keys and values grow with each row's context
    (measured on the built-in runner: 32 rows of one position, 47 ms over contexts of 8
    tokens, 110 over 500). Fitted on passes whose cost holds such a term, the fit recovers
    it and predicts within a percent; within a latency aim, a pass over long contexts has
    room for fewer positions, and a planner that weighs what a position pays sees the
    dearer pass. Without the
    term (context left out of the fit, the planted bug) the same passes are mispredicted
    by a fifth or more."""
    def seconds(rows: int, positions: int, context: int) -> float:
        return 0.004 + 0.001 * rows + 0.0005 * positions + 0.000004 * context

    rng = np.random.default_rng(2)
    passes = []
    for _ in range(200):
        rows = int(rng.integers(1, 33))
        positions = rows * int(rng.integers(1, 6))
        context = rows * int(rng.integers(8, 2000))
        passes.append((rows, positions, context))
    cost, blind = PassCost(), PassCost()
    for rows, positions, context in passes:
        cost.update(rows, positions, seconds(rows, positions, context), context)
        blind.update(rows, positions, seconds(rows, positions, context))
    assert cost.fitted and cost.per_context == pytest.approx(0.000004, rel=1e-2)
    assert cost.predict(32, 32, 32 * 500) == pytest.approx(seconds(32, 32, 32 * 500), rel=1e-2)
    assert cost.error < 0.01 and blind.error > 0.2
    # Within a 100 ms aim, 8 rows over contexts of 1,000 tokens leave 112 positions where
    # over contexts of 8 they leave 175.
    assert (cost.budget(8, 0.1, 8 * 8), cost.budget(8, 0.1, 8 * 1000)) == (175, 112)
    # What a draft's position pays is weighed against the whole pass's cost: over contexts
    # of 8 tokens a pass of 32 tokens costs 53 ms, and a position worth 0.2 of a token
    # (0.5 ms) would lower its tokens per second; over 1,900 it costs 295 ms, and it pays.
    near = [Offer(0, (0.2, 0.1), tree_nodes(None, 2), context=8) for _ in range(32)]
    far = [dataclasses.replace(offer, context=1900) for offer in near]
    assert plan(near, 95, cost).depths == (0,) * 32
    assert all(depth and depth >= 1 for depth in plan(far, 95, cost).depths)
    # The fit without the term charges every row the mean context it saw: it takes the
    # positions that do not pay over short contexts.
    assert plan(near, 95, blind).depths != (0,) * 32


def test_the_fits_error_is_how_far_off_its_predictions_were() -> None:
    """Costs the fit's line misses (here each pass costs alternately 20% more and 20% less
    than its rows and positions say) show as its error."""
    cost = PassCost()
    rng = np.random.default_rng(1)
    assert cost.error == 0  # nothing predicted yet
    for i in range(200):
        rows, positions = int(rng.integers(1, 64)), int(rng.integers(1, 600))
        line = 0.004 + 0.002 * rows + 0.0005 * positions
        cost.update(rows, positions, line * (1.2 if i % 2 else 0.8))
    assert 0.15 < cost.error < 0.3


def test_one_stalled_pass_does_not_hold_the_budget_down_but_a_lasting_change_moves_it(
        ) -> None:
    """A pass whose process was stopped for 5 s (a replica paused, as the balancer test
    does) took the budget from about 950 positions to 7 for a hundred passes, cutting
    every draft; folded in at OUTLIER times its prediction it leaves the budget at about a
    third of that (354), ten times what these passes compute. A cost that triples for good
    is still learned, as fast as the fit forgets (decay 0.97 a pass)."""
    def cost_of(rows: int, positions: int, scale: float = 1.0) -> float:
        return scale * (0.002 + 0.0005 * rows + 0.0001 * positions)

    cost = PassCost()
    rng = np.random.default_rng(0)
    shapes = [(int(r), int(r) * int(rng.integers(2, 6))) for r in rng.integers(1, 8, 200)]
    for rows, positions in shapes[:60]:
        cost.update(rows, positions, cost_of(rows, positions))
    before = cost.budget(4, 0.1)
    assert before is not None and before > 500
    cost.update(5, 25, 5.0)
    after = cost.budget(4, 0.1)
    assert after is not None and after > before / 4
    for rows, positions in shapes[60:200]:
        cost.update(rows, positions, cost_of(rows, positions, scale=3.0))
    assert cost.predict(4, 16) == pytest.approx(cost_of(4, 16, scale=3.0), rel=0.1)


def test_acceptance_by_depth_follows_what_was_verified() -> None:
    source = DepthAcceptance()
    session = DepthAcceptance(source)
    for _ in range(30):
        session.observe(4, 1)  # the second position is always rejected
    rates = session.rates(4)
    assert rates[0] > 0.9 and rates[1] < 0.2
    assert session.budget(0.5, 8) == 1 and session.budget(0.0, 8) == 8
    assert DepthAcceptance(source).rates(2)[1] < 0.3  # a new session starts from its source's
    session.observe(0, 0)  # a cut to nothing teaches nothing
    assert session.rates(4) == pytest.approx(rates, rel=0.1)


def test_a_cut_keeps_a_leading_prefix_of_chains_and_trees() -> None:
    probs = tuple(SparseProbs.from_dense(np.eye(5)[t]) for t in (1, 2, 3))
    tokens, kept, parents, index = cut_draft((1, 2, 3), probs, None, 1)
    assert tokens == (1, 2) and kept == probs[:2] and parents is None and index == (0, 1)
    # A tree: 0 and 1 at depth 1, 2 under 0, 3 under 2, 4 under 1.
    tree = (-1, -1, 0, 2, 1)
    assert tree_nodes(tree, 5) == (2, 4, 5)
    assert cut_draft((7, 8, 9, 10, 11), None, tree, 2) == ((7, 8, 9, 11), None, (-1, -1, 0, 1),
                                                          (0, 1, 2, 4))
    assert cut_draft((7, 8, 9, 10, 11), None, tree, 0) == ((), None, (), ())


@pytest.mark.parametrize("mode,points", [(Mode.EXACT, False), (Mode.MATCH, False),
                                         (Mode.GREEDY, True)])
def test_a_cut_chain_emits_what_the_whole_chain_would_have_up_to_the_cut(
        mode: Mode, points: bool) -> None:
    """With draws keyed by position, a chain cut at any depth emits a prefix of what the
    whole chain emits: its last token is decided as the whole chain's verification decides
    it (an exact-mode draw differs where a drafted token stands and where none does)."""
    vocab, n = 6, 4
    rng = np.random.default_rng(7)
    kept_past = 0
    for trial in range(300):
        dists = [rng.dirichlet(np.full(vocab, 0.5)) for _ in range(n)]
        tokens = [int(rng.choice(vocab, p=d)) for d in dists]
        target = rng.dirichlet(np.full(vocab, 0.5), size=n + 1)
        rows = target.argmax(axis=1) if points else target
        draft_probs = [SparseProbs.from_dense(d) for d in dists]

        def draws(offset: int, trial: int = trial) -> np.random.Generator:
            return np.random.default_rng([trial, offset])

        whole = verify(tokens, rows, draws, mode, draft_probs)
        emitted = [*tokens[:whole.num_accepted], whole.next_token]
        for depth in range(n):
            cut = verify(tokens[:depth + 1], rows[:depth + 1], draws, mode,
                         draft_probs[:depth + 1], cut=True)
            assert cut.num_accepted <= depth
            assert [*tokens[:cut.num_accepted], cut.next_token] == \
                emitted[:cut.num_accepted + 1]
            kept_past += cut.num_accepted == depth and cut.next_token == tokens[depth]
    assert kept_past > 0


def test_only_a_chain_of_a_token_or_more_is_verified_cut() -> None:
    probs = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="chain"):
        verify([], probs[:0], np.random.default_rng(0), Mode.MATCH, cut=True)
    with pytest.raises(ValueError, match="chain"):
        verify([1, 2], probs, np.random.default_rng(0), Mode.MATCH, parents=[-1, -1], cut=True)
    with pytest.raises(ValueError, match=r"\[n, vocab\]"):
        verify([1, 2], np.full((3, 3), 1 / 3), np.random.default_rng(0), Mode.MATCH, cut=True)


# -- lossless by construction, and the planted bug that is not ---------------------------

def verify_prefix(draft_tokens: Sequence[int], target_probs: np.ndarray,
                  rng: np.random.Generator, mode: Mode, draft_probs: Sequence[SparseProbs],
                  depth: int) -> VerifyResult:
    """Verify the draft cut to its first ``depth`` tokens, as the scheduler does."""
    if depth == len(draft_tokens):
        return verify(draft_tokens, target_probs, rng, mode, draft_probs)
    tokens, probs, _, _ = cut_draft(draft_tokens, draft_probs, None, depth)
    return verify(tokens, target_probs[:depth + 1], rng, mode, probs, cut=True)


def verify_shorter(draft_tokens: Sequence[int], target_probs: np.ndarray,
                   rng: np.random.Generator, mode: Mode, draft_probs: Sequence[SparseProbs],
                   depth: int) -> VerifyResult:
    """Verify the draft's first ``depth`` tokens as if that were the whole draft, a bonus
    from the target after them (the planted bugs' cut: where the cut reads what it should
    not, the token at the cut is not the one verification was owed there)."""
    return verify(draft_tokens[:depth], target_probs[:depth + 1], rng, mode,
                  draft_probs[:depth])


def cut_by_draft_confidence(draft_tokens: Sequence[int], target_probs: np.ndarray,
                            rng: np.random.Generator, mode: Mode,
                            draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """A cut chosen before the pass from the draft's own probabilities: keep position
    ``j`` while the draft was sure there (its distribution's top probability at least
    0.3), from none to all. Whether a position is kept depends on the tokens before it,
    never on the one drawn there."""
    depth = 0
    while depth < len(draft_tokens) and float(draft_probs[depth].probs.max()) >= 0.3:
        depth += 1
    return verify_prefix(draft_tokens, target_probs, rng, mode, draft_probs, depth)


def cut_by_the_drawn_tokens_probability(
        draft_tokens: Sequence[int], target_probs: np.ndarray, rng: np.random.Generator,
        mode: Mode, draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """Planted bug: a cut that reads the drafted token itself (keep it while the draft gave
    it at least 0.3). Kept tokens are then no longer samples of the draft's distribution,
    which verification assumes they are."""
    depth = 0
    while depth < len(draft_tokens) and draft_probs[depth].prob_of(draft_tokens[depth]) >= 0.3:
        depth += 1
    return verify_shorter(draft_tokens, target_probs, rng, mode, draft_probs, depth)


def cut_before_the_first_rejection(draft_tokens: Sequence[int], target_probs: np.ndarray,
                                   rng: np.random.Generator, mode: Mode,
                                   draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """Planted bug: the cut chosen after seeing the pass's outcome, just before the first
    rejection, so the token there is a bonus drawn from the target where a correction from
    the residual was due."""
    seen = verify(draft_tokens, target_probs, copy.deepcopy(rng), mode, draft_probs)
    return verify_shorter(draft_tokens, target_probs, rng, mode, draft_probs, seen.num_accepted)


def cut_short_of_the_first_rejection(draft_tokens: Sequence[int], target_probs: np.ndarray,
                                     rng: np.random.Generator, mode: Mode,
                                     draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """Planted bug, in the scheduler's own cut: chosen after seeing the pass's outcome, one
    token short of the first rejection, so that the token decided past the cut is one the
    verifier keeps, and the rejected position goes to a fresh draft."""
    seen = verify(draft_tokens, target_probs, copy.deepcopy(rng), mode, draft_probs)
    depth = max(0, seen.num_accepted - 1) if seen.num_accepted < len(draft_tokens) else \
        len(draft_tokens)
    return verify_prefix(draft_tokens, target_probs, rng, mode, draft_probs, depth)


def test_a_cut_chosen_before_the_pass_is_lossless() -> None:
    setting = SETTINGS[1]  # T = 1, the draft model's own distribution
    p_value = pairs_p_value(simulate(setting, cut_by_draft_confidence).pairs, setting.params)
    print(f"cut by the draft's confidence: chi-square p={p_value:.4f}")
    assert p_value > 0.001


PLANTED = [pytest.param("cut one token short of the first rejection",
                        cut_short_of_the_first_rejection, id="short-of-rejection"),
           pytest.param("cut before the first rejection, its token left out",
                        cut_before_the_first_rejection, id="first-rejection",
                        marks=pytest.mark.slow),
           pytest.param("cut by the drawn token's probability",
                        cut_by_the_drawn_tokens_probability, id="drawn-token",
                        marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,buggy", PLANTED)
def test_a_planted_cut_fails_the_test(name: str, buggy: VerifyFn) -> None:
    setting = SETTINGS[1]
    p_value = pairs_p_value(simulate(setting, buggy).pairs, setting.params)
    print(f"planted bug, {name}: chi-square p={p_value:.3g}")
    assert p_value < 0.001


def test_a_round_that_verified_nothing_leaves_acceptance_as_it_was() -> None:
    """Cloud-only steps verify no position: they neither teach nor decay a session's
    acceptance nor its source's (every empty step decayed the shared prior)."""
    source = DepthAcceptance()
    session = DepthAcceptance(source)
    for _ in range(10):
        session.observe(3, 1)
    before = (list(source._kept), list(source._reached), session.rates(3))
    for _ in range(50):
        session.observe(0, 0)
    assert (source._kept, source._reached, session.rates(3)) == before


def test_a_fit_whose_positions_follow_its_rows_is_not_used() -> None:
    """Passes of every session's token alone (positions = rows) cannot tell a position's
    cost from a row's: the fit is not used (a budget from least squares' split of it
    could cut every draft to nothing for good); once positions vary apart, it is."""
    cost = PassCost()
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 2, 3):
        cost.update(rows, rows, 0.01 + 0.005 * rows)
    assert not cost.fitted
    assert pass_budget(None, cost, 4, 0.1) == START_BUDGET
    for rows, extra in ((2, 8), (3, 0), (4, 12), (5, 3), (2, 0), (6, 9)):
        cost.update(rows, rows + extra, 0.01 + 0.005 * rows + 0.001 * (rows + extra))
    assert cost.fitted


def test_prompts_go_whole_with_nobody_decoding_and_chunks_pay_for_their_row() -> None:
    """With nobody decoding, prompts go whole (a chunk holds up no one and costs a
    forward's fixed cost); beside a session decoding, no chunk is shorter than
    :data:`AMORTISE` times the positions a row's cost buys (40 ms a row, 2.5 ms a position
    here: 64), so a prompt's leftover room of a few tokens is not spent on a chunk."""
    cost = PassCost()
    for rows, positions in ((1, 1), (2, 10), (4, 4), (8, 40), (3, 30), (6, 6), (2, 2), (5, 9)):
        cost.update(rows, positions, 0.040 * rows + 0.0025 * positions)
    assert cost.per_row == pytest.approx(0.040) and cost.per_position == pytest.approx(0.0025)
    prompts = [Offer(300, (), ()), Offer(300, (), ())]
    assert plan(prompts, 100, cost).depths == (0, 0)
    chosen = plan([decoding([]), *prompts], 1 + 100, cost)
    assert chosen.chunks == (0, 100, 0)
    chosen = plan([decoding([]), Offer(80, (), ()), prompts[1]], 1 + 100, cost)
    assert chosen.depths == (0, 0, None)  # the short prompt whole, then 19 left:
    assert chosen.chunks == (0, 0, 0)  # too short a chunk for the second
    assert AMORTISE * 0.040 / 0.0025 == 64


# -- an exact-mode sampled tree: the size of a level is drawn ------------------------------

def tree_out_of_a_binding_budget(drawn: bool, draws: int = 20_000) -> np.ndarray:
    """The first token out of a one-level tree sampled for exact verification, the edge's
    way (a chain token from q = (0.9, 0.1), then a sibling while the mass left beside it is
    at least 0.2), in a pass with one position left for drafts, the planner charging the
    level as :func:`tree_nodes` does with ``drawn``: counts of each token [2]."""
    from spececd.edge.drafter import _drawn_siblings

    draft = SparseProbs(np.array([0, 1]), np.array([0.9, 0.1], dtype=np.float32))
    target_probs = np.full((3, 2), 0.5)  # [nodes + 1, vocab]: p = (0.5, 0.5) at the root
    rng = np.random.default_rng(7)
    counts = np.zeros(2, dtype=np.int64)
    for _ in range(draws):
        token = sample_sparse(draft, rng)
        nodes = [(token, draft), *_drawn_siblings(draft, token, rng, 1, 0.2)]
        tokens = [t for t, _ in nodes]
        probs = [d for _, d in nodes]
        parents = [-1] * len(nodes)
        offers = [Offer(0, (0.9,), tree_nodes(parents, len(tokens), drawn=drawn)),
                  decoding(())]
        depth = plan(offers, 3).depths[0]  # two sessions' tokens and one position more
        assert depth is not None
        cut_tokens, cut_probs, cut_parents, _ = cut_draft(tokens, probs, parents, depth)
        result = verify(cut_tokens, target_probs[:len(cut_tokens) + 1], rng, Mode.EXACT,
                        cut_probs, parents=cut_parents)
        counts[cut_tokens[result.num_accepted - 1] if result.num_accepted
               else result.next_token] += 1
    return counts


@pytest.mark.parametrize("drawn", [True, False], ids=["charged-before-draws", "planted-by-size"])
def test_a_cut_of_an_exact_mode_sampled_tree_is_lossless(drawn: bool) -> None:
    """Charged one position a level, the tree is cut whatever it drew, and the token is the
    target's (0.5 each); the planted bug weighs the level by its size, which its draw sets
    (the likely token leaves too little mass for a sibling and fits), and gives 0.55."""
    counts = tree_out_of_a_binding_budget(drawn)
    p_value = chi_square_p(counts, np.full(2, counts.sum() / 2))
    print(f"tree charged {'before its draws' if drawn else 'by its size'}: "
          f"{counts / counts.sum()}, chi-square p={p_value:.3g}")
    assert (p_value > 0.001) == drawn


def test_no_pass_computes_more_than_the_cap() -> None:
    """The cap from memory (``max_batched_tokens``) holds where the budget lets a pass run
    whole: 32 prompts of 4k tokens joining at once with nobody decoding, one prompt alone,
    and no budget at all, go in chunks within it, first come first served; beside sessions
    decoding it bounds the budget (drafts cut by worth), every session's token still
    goes; within it, nothing changes."""
    joining = [Offer(4096, (0.5,) * 4, tree_nodes(None, 4)) for _ in range(32)]
    for budget in (None, 100_000):
        chosen = plan(joining, budget, cap=2048)
        assert chosen.positions(joining) <= 2048
        assert chosen.chunks[:1] == (2048,) and sum(chosen.chunks) == 2048
        assert all(depth is None for depth in chosen.depths)
    lone = [Offer(10_000, (), ())]
    assert plan(lone, None, cap=2048).chunks == (2048,)
    small = [Offer(300, (), ()), Offer(200, (), ()), Offer(2000, (), ())]
    chosen = plan(small, None, cap=2048)
    assert chosen.depths[:2] == (0, 0) and chosen.chunks == (0, 0, 2048 - 301 - 201)
    deciding = [decoding([0.9] * 64) for _ in range(32)]
    chosen = plan(deciding, None, cap=1024)
    assert chosen.positions(deciding) <= 1024 and all(d is not None for d in chosen.depths)
    assert plan(deciding, None, cap=4096).depths == (64,) * 32  # within it: whole
