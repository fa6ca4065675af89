"""Verification: exact hand-made cases, then statistical proof that it is lossless.

The statistical tests run the real drafting-and-verification loop on toy Markov models
(target and draft logits depend on the previous token), draw the first two emitted tokens
20,000 times, and compare their joint distribution with the target's own by chi-square.
Planted bugs from shipped projects must fail the same test: that is its teeth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from spececd.core.params import Mode, SamplingParams
from spececd.core.sampling import (
    SparseProbs,
    draft_distribution,
    process_logits,
    sample,
    sample_sparse,
)
from spececd.core.stopping import clip_emitted
from spececd.core.verify import VerifyResult, verify
from tests.chisq import chi_square_p

V = 8
DRAWS = 20_000
K = 3
_tables = np.random.default_rng(42)
TARGET_LOGITS = _tables.normal(size=(V, V)) * 1.5  # row: previous token
DRAFT_LOGITS = TARGET_LOGITS + _tables.normal(size=(V, V)) * 1.2

# -- exact cases --------------------------------------------------------------------


LOSSLESS = [mode for mode in Mode if not mode.lossy]  # threshold has tests of its own


def one_hot(rows: Sequence[int], vocab: int = 5) -> np.ndarray:
    out = np.zeros((len(rows), vocab))
    out[np.arange(len(rows)), rows] = 1.0
    return out


def point(token: int) -> SparseProbs:
    return SparseProbs(np.array([token]), np.array([1.0], dtype=np.float32))


@pytest.mark.parametrize("mode", LOSSLESS)
def test_forced_target_accepts_matching_drafts_and_adds_bonus(mode: Mode) -> None:
    rng = np.random.default_rng(0)
    target = one_hot([1, 2, 3, 4])
    draft_probs = [point(1), point(2), point(3)]
    assert verify([1, 2, 3], target, rng, mode, draft_probs) == VerifyResult(3, 4)


@pytest.mark.parametrize("mode", LOSSLESS)
def test_first_mismatch_is_corrected_to_the_forced_token(mode: Mode) -> None:
    rng = np.random.default_rng(0)
    target = one_hot([1, 2, 3, 4])
    draft_probs = [point(1), point(0), point(3)]
    assert verify([1, 0, 3], target, rng, mode, draft_probs) == VerifyResult(1, 2)


def test_exact_correction_comes_from_the_residual() -> None:
    # target [.5 .5 0], draft [1 0 0]: token 0 is accepted with p .5; on rejection the
    # residual max(0, p - q) = [0 .5 0] forces token 1.
    target = np.array([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    rng = np.random.default_rng(3)
    results = [verify([0], target, rng, Mode.EXACT, [point(0)]) for _ in range(2000)]
    rejected = [r for r in results if r.num_accepted == 0]
    assert {r.next_token for r in rejected} == {1}
    assert 0.45 < len(rejected) / len(results) < 0.55


def test_empty_draft_samples_the_bonus() -> None:
    rng = np.random.default_rng(0)
    assert verify([], one_hot([3]), rng, Mode.EXACT, []) == VerifyResult(0, 3)


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("parents", [None, (-1, -1, 0, 2, 2)])
def test_the_targets_tokens_verify_as_their_one_hot_rows_without_a_draw(
        mode: Mode, parents: tuple[int, ...] | None) -> None:
    """Temperature 0: the target's tokens ``[n + 1]`` stand for one-hot rows in every mode,
    a chain or a tree, and no generator is made."""
    def no_draw(depth: int) -> np.random.Generator:
        raise AssertionError("a point mass needs no draw")

    for seed in range(50):
        cases = np.random.default_rng(seed)
        draft = [int(t) for t in cases.integers(0, 3, 5)]
        chosen = cases.integers(0, 3, 6)
        dists = [SparseProbs(np.array([t]), np.array([1.0], dtype=np.float32)) for t in draft]
        expected = verify(draft, one_hot(list(chosen), 3), np.random.default_rng(seed), mode,
                          dists, 0.5, parents)
        assert verify(draft, chosen, no_draw, mode, dists, 0.5, parents) == expected


def test_shapes_are_checked() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="n \\+ 1"):
        verify([1, 2], one_hot([1, 2]), rng, Mode.MATCH)
    with pytest.raises(ValueError, match="draft distribution"):
        verify([1], one_hot([1, 2]), rng, Mode.EXACT, None)
    with pytest.raises(ValueError, match="n \\+ 1"):
        verify([1, 2], np.array([1, 2]), rng, Mode.MATCH)  # the target's tokens: n + 1 too


@pytest.mark.parametrize("tokens,stops,remaining,expected", [
    ([5, 6, 7], [], 10, ([5, 6, 7], False)),
    ([5, 6, 7], [6], 10, ([5, 6], True)),  # the stop token is emitted, nothing after it
    ([5, 6, 7], [], 2, ([5, 6], True)),  # never more than max_tokens
    ([5, 6, 7], [7], 3, ([5, 6, 7], True)),
    ([5, 6], [9], 2, ([5, 6], True)),
])
def test_clip_emitted(tokens: list[int], stops: list[int], remaining: int,
                      expected: tuple[list[int], bool]) -> None:
    assert clip_emitted(tokens, stops, remaining) == expected


# -- statistical tests --------------------------------------------------------------

VerifyFn = Callable[..., VerifyResult]


@dataclass(frozen=True)
class Setting:
    name: str
    params: SamplingParams
    draft: str = "model"  # model | uniform | onehot_wrong | truncated_no_top
    mode: Mode = Mode.EXACT


SETTINGS = [
    Setting("T=0.7", SamplingParams(temperature=0.7)),
    Setting("T=1.0", SamplingParams(temperature=1.0)),
    Setting("T=1.5", SamplingParams(temperature=1.5)),
    Setting("top-k=3", SamplingParams(temperature=1.0, top_k=3)),
    Setting("top-p=0.8", SamplingParams(temperature=1.0, top_p=0.8)),
    Setting("uniform draft", SamplingParams(temperature=1.0), draft="uniform"),
    Setting("one-hot wrong draft", SamplingParams(temperature=1.0), draft="onehot_wrong"),
    Setting("support without the top token", SamplingParams(temperature=1.0),
            draft="truncated_no_top"),
    Setting("match T=1.0", SamplingParams(temperature=1.0), mode=Mode.MATCH),
    Setting("match top-p=0.8", SamplingParams(temperature=0.9, top_p=0.8), mode=Mode.MATCH),
]


def target_table(params: SamplingParams) -> np.ndarray:  # [V, V]: row = previous token
    return process_logits(TARGET_LOGITS, params)


def draft_table(setting: Setting) -> list[SparseProbs]:
    target = target_table(setting.params)
    dists = []
    for row in range(V):
        if setting.draft == "model":
            dists.append(draft_distribution(DRAFT_LOGITS[row], setting.params, max_support=V,
                                            history=()))
        elif setting.draft == "uniform":
            dists.append(SparseProbs.from_dense(np.full(V, 1.0 / V)))
        elif setting.draft == "onehot_wrong":
            dists.append(point(int(np.argmin(target[row]))))
        else:
            q = target[row].copy()
            q[np.argmax(q)] = 0.0
            dists.append(SparseProbs.from_dense(q / q.sum()))
    return dists


@dataclass
class Outcome:
    pairs: np.ndarray  # [DRAWS] first two emitted tokens, as a * V + b
    first_accepted: int  # first rounds whose first drafted token was accepted


def simulate(setting: Setting, verify_fn: VerifyFn = verify, seed: int = 0,
             reported: list[SparseProbs] | None = None) -> Outcome:
    """Run DRAWS generations of two tokens after the prompt [0] through draft + verify.
    ``reported`` replaces the distributions the drafter reports (not those it samples)."""
    target = target_table(setting.params)
    drafts = draft_table(setting)
    reported = reported or drafts
    draft_rng, verify_rng = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    pairs = np.empty(DRAWS, dtype=np.int64)
    first_accepted = 0
    for d in range(DRAWS):
        history, out = [0], []
        while len(out) < 2:
            drafted: list[int] = []
            context = history[-1]
            for _ in range(K):
                if setting.mode is Mode.EXACT:
                    token = sample_sparse(drafts[context], draft_rng)
                else:
                    token = sample(drafts[context].dense(V), draft_rng)
                drafted.append(token)
                context = token
            rows = [history[-1], *drafted]
            result = verify_fn(drafted, target[rows], verify_rng, setting.mode,
                               [reported[r] for r in rows[:-1]])
            if not out and result.num_accepted > 0:
                first_accepted += 1
            emitted = [*drafted[:result.num_accepted], result.next_token]
            out.extend(emitted)
            history.extend(emitted)
        pairs[d] = out[0] * V + out[1]
    return Outcome(pairs, first_accepted)


def pairs_p_value(pairs: np.ndarray, params: SamplingParams) -> float:
    """p-value of the observed first-two-token pairs under the target's own distribution."""
    target = target_table(params)
    expected = (target[0][:, None] * target).reshape(-1) * pairs.size
    return chi_square_p(np.bincount(pairs, minlength=V * V), expected)


def expected_first_acceptance(setting: Setting) -> float:
    p = target_table(setting.params)[0]
    q = draft_table(setting)[0].dense(V)
    return float(np.minimum(p, q).sum() if setting.mode is Mode.EXACT else (p * q).sum())


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_output_follows_the_target_distribution(setting: Setting) -> None:
    outcome = simulate(setting)
    p_value = pairs_p_value(outcome.pairs, setting.params)
    alpha = expected_first_acceptance(setting)
    measured = outcome.first_accepted / DRAWS
    stderr = max(np.sqrt(alpha * (1 - alpha) / DRAWS), 1 / DRAWS)
    print(f"{setting.name}: chi-square p={p_value:.4f} acceptance {measured:.4f} "
          f"expected {alpha:.4f} (3 SE = {3 * stderr:.4f})")
    assert p_value > 0.001
    assert abs(measured - alpha) <= 3 * stderr


# Planted bugs, each a bug class that shipped in another project.

def verify_without_residual(draft_tokens: Sequence[int], target_probs: np.ndarray,
                            rng: np.random.Generator, mode: Mode,
                            draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """On rejection, emit a fresh sample of the target instead of a residual draw."""
    for i, token in enumerate(draft_tokens):
        if rng.random() >= min(1.0, target_probs[i, token] / draft_probs[i].prob_of(token)):
            return VerifyResult(i, sample(target_probs[i], rng))
    return VerifyResult(len(draft_tokens), sample(target_probs[-1], rng))


def verify_inverted_ratio(draft_tokens: Sequence[int], target_probs: np.ndarray,
                          rng: np.random.Generator, mode: Mode,
                          draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """Accept with min(1, q/p) instead of min(1, p/q)."""
    for i, token in enumerate(draft_tokens):
        q, p = draft_probs[i].prob_of(token), target_probs[i, token]
        if p == 0 or rng.random() >= min(1.0, q / p):
            residual = np.maximum(target_probs[i] - draft_probs[i].dense(V), 0)
            return VerifyResult(i, sample(residual if residual.sum() else target_probs[i], rng))
    return VerifyResult(len(draft_tokens), sample(target_probs[-1], rng))


def verify_accept_on_match(draft_tokens: Sequence[int], target_probs: np.ndarray,
                           rng: np.random.Generator, mode: Mode,
                           draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """'Probabilistic' acceptance that also accepts when the target's own sample matches,
    and emits that sample on rejection."""
    for i, token in enumerate(draft_tokens):
        own = sample(target_probs[i], rng)
        ratio = target_probs[i, token] / draft_probs[i].prob_of(token)
        if not (own == token or rng.random() < min(1.0, ratio)):
            return VerifyResult(i, own)
    return VerifyResult(len(draft_tokens), sample(target_probs[-1], rng))


BUGS = [
    ("no residual", verify_without_residual, SETTINGS[1]),
    ("inverted ratio", verify_inverted_ratio, SETTINGS[1]),
    ("accept on match", verify_accept_on_match, SETTINGS[5]),
]


@pytest.mark.parametrize("name,buggy,setting", BUGS, ids=[b[0] for b in BUGS])
def test_planted_verifier_bugs_fail_the_test(name: str, buggy: VerifyFn, setting: Setting) -> None:
    p_value = pairs_p_value(simulate(setting, buggy).pairs, setting.params)
    print(f"planted bug {name}: chi-square p={p_value:.3g}")
    assert p_value < 0.001


def test_reporting_raw_draft_probs_fails_the_test() -> None:
    """The drafter samples from its top-k distribution but reports the unprocessed one."""
    setting = SETTINGS[3]  # top-k = 3
    raw = [SparseProbs.from_dense(process_logits(DRAFT_LOGITS[r:r + 1],
                                                 SamplingParams(temperature=1.0))[0])
           for r in range(V)]
    p_value = pairs_p_value(simulate(setting, reported=raw).pairs, setting.params)
    print(f"planted bug raw q: chi-square p={p_value:.3g}")
    assert p_value < 0.001


def verify_without_min(draft_tokens: Sequence[int], target_probs: np.ndarray,
                       rng: np.random.Generator, mode: Mode,
                       draft_probs: Sequence[SparseProbs]) -> VerifyResult:
    """Acceptance test ``u < p/q`` with no ``min(1, .)``."""
    for i, token in enumerate(draft_tokens):
        if not rng.random() < target_probs[i, token] / draft_probs[i].prob_of(token):
            residual = np.maximum(target_probs[i] - draft_probs[i].dense(V), 0)
            return VerifyResult(i, sample(residual if residual.sum() else target_probs[i], rng))
    return VerifyResult(len(draft_tokens), sample(target_probs[-1], rng))


def test_acceptance_without_min_is_the_same_verifier() -> None:
    """For u ~ U[0, 1), ``u < p/q`` and ``u < min(1, p/q)`` are the same event: omitting the
    min is not a bug, so it cannot fail the distribution test. It gives our verdicts."""
    setting = SETTINGS[1]
    a = simulate(setting, verify)
    b = simulate(setting, verify_without_min)
    np.testing.assert_array_equal(a.pairs, b.pairs)
