"""The adaptive draft-length policy: exact cases on fed measurements."""

from __future__ import annotations

import random

import pytest

from spececd.core.policy import DraftLengthPolicy


def feed(policy: DraftLengthPolicy, accept_prob: float, draft_ms: float, verify_ms: float,
         network_ms: float, rounds: int = 300) -> None:
    """Rounds of k_max drafts where each position is accepted with ``accept_prob`` (seeded);
    the verify pass costs ``verify_ms`` plus 0.1 ms per drafted token."""
    rng = random.Random(0)
    for _ in range(rounds):
        k = policy.k_max
        accepted = 0
        while accepted < k and rng.random() < accept_prob:
            accepted += 1
        policy.observe(k, accepted, k * draft_ms / 1000, (verify_ms + 0.1 * k) / 1000,
                       network_ms / 1000)


def test_starts_at_k_initial_and_respects_the_limit() -> None:
    policy = DraftLengthPolicy(k_max=8, k_initial=4)
    assert policy.choose() == 4
    assert policy.choose(limit=2) == 2
    assert policy.choose(limit=0) == 0


def test_acceptance_estimates_are_conditional_per_position() -> None:
    policy = DraftLengthPolicy(k_max=3, prior_weight=0.0001, decay=1.0)
    for _ in range(10):
        policy.observe(3, 1, 0.003, 0.01, 0.0)  # position 0 kept, position 1 rejected
    a = policy.acceptance()
    assert a[0] == pytest.approx(1.0, abs=1e-3) and a[1] == pytest.approx(0.0, abs=1e-3)
    assert a[2] == pytest.approx(0.0, abs=1e-3)  # never reached: the position before's


def test_a_position_never_drafted_inherits_the_estimate_before_it() -> None:
    policy = DraftLengthPolicy(k_max=8, prior_accept=0.6, decay=1.0)
    for _ in range(200):  # k=4 only, everything accepted
        policy.observe(4, 4, 0.003, 0.01, 0.05)
    a = policy.acceptance()
    assert a[3] > 0.95 and a[7] == pytest.approx(a[3])  # not pulled back to 0.6
    assert policy.choose() == 8  # so a costly round trip makes it try longer drafts


def test_good_drafts_and_costly_round_trips_draft_longer() -> None:
    cheap = DraftLengthPolicy(k_max=8)
    feed(cheap, accept_prob=0.3, draft_ms=2.0, verify_ms=5.0, network_ms=0.0)
    costly = DraftLengthPolicy(k_max=8)
    feed(costly, accept_prob=0.9, draft_ms=0.5, verify_ms=5.0, network_ms=40.0)
    assert costly.choose() > cheap.choose()
    assert costly.choose() == 8


def test_expected_tokens_follow_the_acceptance_chain() -> None:
    policy = DraftLengthPolicy(k_max=3, prior_accept=0.5, prior_weight=1.0)
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_proactive_hits_hide_the_drafting_cost() -> None:
    plain = DraftLengthPolicy(k_max=8)
    proactive = DraftLengthPolicy(k_max=8, proactive=True)
    for policy in (plain, proactive):
        for _ in range(50):
            policy.observe(4, 4, 0.004, 0.006, 0.02)
    assert proactive.cost(4) < plain.cost(4)
    assert proactive.cost(4) == pytest.approx(max(4 * 0.001, 0.006 + 0.02), rel=0.05)
