"""Adaptive draft length: choose ``k`` each round from a cost model fed by live measurements.

A round that drafts ``k`` tokens gains, in expectation,
``E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i`` tokens, where ``a_i`` is the probability that
position ``i`` is accepted given that the positions before it were. It costs
``k * t_draft + t_round(k)``: ``t_draft`` is one draft step, ``t_round(k)`` everything from
sending the draft to having the verdict (the verify pass, modelled as
``t_verify0 + k * t_verify_per_token``, plus the network round trip). The policy picks the
``k`` in ``[1, k_max]`` with the most tokens per second, ``E(k) / cost(k)``.

With proactive drafting the next block is drafted while the verdict is in flight, so the
drafting hides behind the round trip: the cost becomes ``max(k * t_draft, t_round(k))``
for rounds that hit. A round hits when all ``k`` drafts are accepted and the bonus token
is the one guessed, probability ``a_1 ... a_k a_{k+1}`` from the same estimates, so a
longer draft hides less (the hit rate measured in the statistics belongs to the ``k``
values tried so far, so the policy does not use it).

Every estimate is an exponential moving average, so the choice follows a changing network
or a change of topic. Each position's acceptance is shrunk toward a prior over
``prior_weight`` pseudo-rounds so that the first rounds are not decided by noise: for the
first position ``prior_accept``, for each later one the estimate of the position before
it. A position the policy has rarely drafted so inherits what was learnt just before it
(conditional acceptance changes slowly along a block) instead of a fixed guess, which
would keep the policy from ever trying longer drafts. Pure: no clock, no I/O; the caller
feeds measurements in seconds.

Which *way* to speculate (rounds or stream drafting, block-ahead or plain) is chosen
by :mod:`spececd.core.chooser`, whose names this module re-exports. The same cost model,
fed by what stream drafting measures (:class:`RoundsEstimate`), tells the chooser what
rounds would bring while it streams.

The same model shapes **token trees** (:meth:`DraftLengthPolicy.tree_shape`). A sibling
candidate ``s`` at depth ``i`` gains one token when the target's token there is ``s``:
in expectation ``reach_i * q(s)``, with ``reach_i = a_1 ... a_{i-1}`` the chance the round
gets that far and ``q`` the draft's own probability. It costs one more position in the
verify pass, ``t_verify_per_token``. It pays when the gain is at least that cost times the
tokens per second rounds give, ``t_verify_per_token * E(k) / cost(k)``: the floor. A long
round trip lowers the tokens per second and so the floor, and trees grow; on a fast link
where each verified position is dear, they shrink to chains. Delay-aware by construction.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# The strategy chooser lived here; its names stay importable from this module.
from spececd.core.chooser import STAGES, Arm, HintGate, StrategyChooser, relative_speed, stage


@dataclass
class Ema:
    """An exponential moving average; the first value is taken as it is."""

    value: float
    weight: float = 0.2
    seen: bool = False

    def update(self, x: float) -> None:
        """Fold in ``x`` (taken as it is when it is the first)."""
        self.value = x if not self.seen else (1 - self.weight) * self.value + self.weight * x
        self.seen = True


@dataclass
class LinearFit:
    """``y ~ base + slope * x`` by least squares over exponentially weighted observations
    (weight ``weight`` for the newest): how a verify pass's time grows with the positions
    it computes. Without two different ``x`` seen, the slope is 0 and the base the mean."""

    weight: float = 0.2
    seen: bool = False
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def update(self, x: float, y: float) -> None:
        """Fold in one observation ``(x, y)`` with the newest's weight."""
        w = self.weight if self.seen else 1.0
        self._x += w * (x - self._x)
        self._y += w * (y - self._y)
        self._xx += w * (x * x - self._xx)
        self._xy += w * (x * y - self._xy)
        self.seen = True

    @property
    def slope(self) -> float:
        """The fitted slope, never negative; 0 until two different ``x`` were seen."""
        variance = self._xx - self._x * self._x
        if variance <= 1e-9 * max(1.0, self._xx):
            return 0.0
        return max(0.0, (self._xy - self._x * self._y) / variance)

    @property
    def base(self) -> float:
        """The fitted value at ``x = 0``, never negative."""
        return max(0.0, self._y - self.slope * self._x)


FIRST_FLOOR = 0.1  # a sibling's expected gain before anything is measured


def expected_tokens(acceptance: Sequence[float]) -> float:
    """Tokens a round gains in expectation, ``E(k)`` of the module docstring, for a draft of
    ``len(acceptance)`` tokens whose ``i``-th is accepted with probability ``acceptance[i]``
    when all before it were: the verifier's own token and every draft kept."""
    gain, survive = 1.0, 1.0
    for a in acceptance:
        survive *= a
        gain += survive
    return gain


def round_cost(k: int, draft_step_s: float, round_trip_s: float, hit: float) -> float:
    """Seconds a round of ``k`` drafted tokens costs: drafting them (``draft_step_s``
    each) and the round trip (the verify pass and the network), the one hidden behind the
    other when the round hits (probability ``hit``; 0 for plain rounds, which draft only
    after the verdict)."""
    drafting = k * draft_step_s
    return hit * max(drafting, round_trip_s) + (1 - hit) * (drafting + round_trip_s)


@dataclass(frozen=True)
class TreeShape:
    """What a drafter needs to branch a chain of ``k``: at most ``width`` candidates per
    position and ``budget`` nodes in all; ``reach[i]``, the chance the round reaches depth
    ``i``; and ``floor``, the least expected gain a sibling must bring."""

    width: int
    budget: int
    reach: tuple[float, ...]
    floor: float


@dataclass
class DraftLengthPolicy:
    k_max: int = 8
    k_initial: int = 4
    prior_accept: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.98  # per-round forgetting of acceptance counts
    proactive: bool = False
    _accepted: list[float] = field(default_factory=list)  # position i: times accepted
    _tried: list[float] = field(default_factory=list)  # position i: times reached
    _draft_step: Ema = field(default_factory=lambda: Ema(0.0))
    # The verify pass, two ways. For choosing k, as it has been measured to choose best: a
    # fixed part from the first round (which also ran over the prompt) and rounds of one
    # token, the rest spread per token. For tree shapes, a least-squares fit that leaves
    # the first round out and matches measured pass costs; k chosen with it was about 10%
    # slower in-process with the default pair (docs/benchmarks-2026-11-22-trees.md).
    _verify_base: Ema = field(default_factory=lambda: Ema(0.0))
    _verify_per_token: Ema = field(default_factory=lambda: Ema(0.0))
    _verify: LinearFit = field(default_factory=LinearFit)  # seconds by positions verified
    _network: Ema = field(default_factory=lambda: Ema(0.0))
    rounds: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError("k_max must be >= 1")
        self.k_initial = max(1, min(self.k_initial, self.k_max))
        self._accepted = [0.0] * self.k_max
        self._tried = [0.0] * self.k_max

    def acceptance(self) -> list[float]:
        """Estimated ``a_i``: acceptance at position i given all before it were accepted."""
        estimates, prior = [], self.prior_accept
        for accepted, tried in zip(self._accepted, self._tried, strict=True):
            prior = (accepted + self.prior_weight * prior) / (tried + self.prior_weight)
            estimates.append(prior)
        return estimates

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
                network_s: float, positions: int | None = None, timed: bool = True) -> None:
        """Feed one round: tokens drafted and accepted, the drafting time, the verifier's
        reported time, and the rest of the round trip; ``positions``: what the verifier
        computed (a tree's nodes; default ``drafted``). ``timed=False``: the round's verify
        and network times carry a one-off wait (a switch from streaming: a new hello, the
        server catching up) and are left out; its acceptance and drafting still count."""
        positions = drafted if positions is None else positions
        self.rounds += 1
        self._accepted = [a * self.decay for a in self._accepted]
        self._tried = [t * self.decay for t in self._tried]
        for i in range(min(drafted, accepted + 1)):  # positions reached this round
            self._tried[i] += 1
            if i < accepted:
                self._accepted[i] += 1
        if drafted > 0 and draft_s > 0:
            self._draft_step.update(draft_s / drafted)
        if not timed:
            return
        if drafted <= 1 or not self._verify_base.seen:
            self._verify_base.update(verify_s)
        else:
            slope = max(0.0, (verify_s - self._verify_base.value) / drafted)
            self._verify_per_token.update(slope)
        if self.rounds > 1:  # the first round's pass also ran over the prompt
            self._verify.update(positions, verify_s)
        self._network.update(max(0.0, network_s))

    def expected_tokens(self, k: int) -> float:
        """Tokens a round of ``k`` drafted tokens gains in expectation, with the acceptance
        measured so far (:func:`expected_tokens`)."""
        return expected_tokens(self.acceptance()[:k])

    def cost(self, k: int, fitted: bool = False) -> float:
        """Seconds a round of ``k`` costs; ``fitted``: with the least-squares verify model."""
        verify = (self._verify.base + k * self._verify.slope if fitted
                  else self._verify_base.value + k * self._verify_per_token.value)
        hit = 0.0
        if self.proactive:
            a = self.acceptance()  # past k_max, the bonus guess takes the last estimate
            hit = math.prod(a[min(i, len(a) - 1)] for i in range(k + 1))
        return round_cost(k, self._draft_step.value, verify + self._network.value, hit)

    def tree_shape(self, k: int, width: int, budget: int) -> TreeShape:
        """How to branch a chain of ``k`` (see the module docstring)."""
        reach = [1.0]
        for a in self.acceptance()[:max(0, k - 1)]:
            reach.append(reach[-1] * a)
        floor = FIRST_FLOOR
        if self._verify.seen and self._draft_step.seen:
            floor = (self._verify.slope * self.expected_tokens(k)
                     / max(self.cost(k, fitted=True), 1e-9))
        return TreeShape(width, budget, tuple(reach[:k]), floor)

    def choose(self, limit: int | None = None) -> int:
        """The draft length for the next round, at most ``limit`` (e.g. tokens left)."""
        top = min(self.k_max, limit) if limit is not None else self.k_max
        if top <= 0:
            return 0
        if not self._draft_step.seen or not self._verify_base.seen:
            return min(self.k_initial, top)
        return max(range(1, top + 1),
                   key=lambda k: self.expected_tokens(k) / max(self.cost(k), 1e-9))


def hint_shape(width: int, n: int, ahead: int, acceptance: float, position_s: float,
               step_s: float) -> TreeShape:
    """How to branch ``n`` tokens of a stream-drafting hint that follow ``ahead`` drafted
    tokens the server has yet to verify: the chance the server gets to the hint's ``i``-th
    token is ``acceptance ** (ahead + i)`` (the share of hinted tokens it keeps, per
    token), and a sibling pays when its expected gain covers what one more verified
    position costs the server against a step of its own (``position_s / step_s``;
    :data:`FIRST_FLOOR` before both are measured)."""
    floor = position_s / step_s if position_s > 0 and step_s > 0 else FIRST_FLOOR
    reach = tuple(acceptance ** (ahead + i) for i in range(n))
    return TreeShape(width, n * width, reach, floor)


def stream_lookahead(depth: int, rtt_s: float, step_s: float, cap: int) -> int:
    """How far past the last token it received stream drafting should draft: ``depth``
    tokens beyond what the server will have generated by the time a hint sent now reaches
    it. The edge's newest token left the server half a round trip ago and the hint takes
    another half, so the server is about ``rtt_s / step_s`` tokens further on; drafts short
    of that arrive stale. At most ``cap`` (the server's longest draft); 0 when even that
    falls short (every hint would be stale: draft nothing)."""
    lag = math.ceil(rtt_s / step_s) if rtt_s > 0 and step_s > 0 else 0
    return 0 if lag >= cap else min(cap, depth + lag)


# auto, streaming: the server alone is measured only where hints bring less than this many
# times its own step's speed (RoundsEstimate.cloud_cap)
CLOUD_CAP_MARGIN = 1.25
LONE_STEPS = 16  # the server's last steps without hints that bound what it brings alone


@dataclass
class RoundsEstimate:
    """What rounds would bring on this link, from what stream drafting measures: so that
    ``--proactive auto`` need not leave streaming, and lose the rest of a generation, to
    learn that rounds are slower.

    A server step that verified ``drafted`` hinted tokens and kept ``accepted`` of them is
    a verify pass over a draft of that length, as in a round: steps give the verify pass's
    seconds by positions (one that verified none is a cloud-only step) and the draft's
    acceptance per token (kept over reached: a draft is reached up to its first
    rejection). With the draft's step and the round trip, rounds of ``k`` would bring
    ``E(k)`` tokens per :func:`round_cost`, block-ahead's (which hides drafting behind the
    round trip when a round hits, so it is at least plain rounds' speed), and
    :meth:`speed` is the best over ``k``. It errs for rounds, so that they are measured
    where they might win: the edge's and the server's own overheads per round are left
    out, and the hints a server verifies follow drafted tokens it generated too, so their
    acceptance is, if anything, above a round's (about 1.4 times the speed rounds were
    measured at, on the default pair on a busy 2-core machine).

    ``ceiling``: every draft counts as kept, ``k + 1`` tokens per round, the most rounds
    could bring (for exact verification of sampled drafts, which keeps at least as many as
    match, by which hints are verified). Before a server step is measured the verify pass
    counts as free: ``k_max + 1`` tokens per round trip. Pure: the caller feeds it.
    """

    decay: float = 0.98  # per step that verified hints, of the acceptance counts
    prior: float = 2.0  # positions reached and kept before any is measured
    _accepted: float = 0.0
    _reached: float = 0.0
    # Slow, over the steps of many generations; steps that verified no hint pin the base.
    _verify: LinearFit = field(default_factory=lambda: LinearFit(weight=0.05))
    _draft_step: Ema = field(default_factory=lambda: Ema(0.0))
    _lone: Ema = field(default_factory=lambda: Ema(0.0))  # a step that verified no hint
    _lone_last: deque[float] = field(default_factory=lambda: deque(maxlen=LONE_STEPS))

    def step(self, drafted: int, accepted: int, seconds: float) -> None:
        """Feed a server step that verified ``drafted`` hinted tokens, kept ``accepted`` and
        took ``seconds`` (leave out a step that also ran over a new context)."""
        if seconds > 0:
            self._verify.update(drafted, seconds)
            if drafted == 0:
                self._lone.update(seconds)
                self._lone_last.append(seconds)
        self.round(drafted, accepted)

    def round(self, drafted: int, accepted: int) -> None:
        """Feed a draft of ``drafted`` tokens of which the first ``accepted`` were kept: a
        step's hints (:meth:`step`), or a round that ran (``--proactive auto`` probing
        rounds), so that once rounds were measured their estimate keeps what they
        measured, and hints that all arrived too late to be verified leave the prior."""
        if drafted > 0:
            self._accepted = self.decay * self._accepted + accepted
            self._reached = self.decay * self._reached + min(drafted, accepted + 1)

    def drafted(self, tokens: int, seconds: float) -> None:
        """Feed the edge's drafting: ``tokens`` drafted in ``seconds`` (ignored when either
        is 0)."""
        if tokens > 0 and seconds > 0:
            self._draft_step.update(seconds / tokens)

    def acceptance(self) -> float:
        """The share of drafted tokens the server keeps, per token reached."""
        return (self._accepted + self.prior) / (self._reached + self.prior)

    def cloud_only(self) -> float:
        """Tokens per second of the server generating alone, one per step, by its steps that
        verified no hint (0: none measured). Not the verify fit's base: where every step
        verified as many hinted positions (hints always topped up) the fit has no spread to
        extrapolate from, and its base is the hinted step, which would put the server alone
        below what it brings."""
        step = self._lone.value
        return 1 / step if self._lone.seen and step > 0 else 0.0

    def cloud_cap(self) -> float:
        """The most tokens per second the server alone could bring here, as far as
        streaming with hints tells (a :meth:`~spececd.core.chooser.StrategyChooser.cap` of
        :attr:`~spececd.core.chooser.Arm.CLOUD`): :data:`CLOUD_CAP_MARGIN` tokens per the
        fastest of the server's last :data:`LONE_STEPS` steps without hints (a step, the
        edge's and the link's overheads left out, erring for it; the fastest, so that a
        step slowed by load does not cap it out), ``math.inf`` before half as many were
        measured."""
        if len(self._lone_last) < LONE_STEPS // 2:
            return math.inf
        return CLOUD_CAP_MARGIN / max(min(self._lone_last), 1e-9)

    def speed(self, k_max: int, rtt_s: float, ceiling: bool = False) -> float:
        """Tokens per second rounds of at most ``k_max`` drafted tokens would bring over
        a round trip of ``rtt_s`` (``math.inf`` when nothing is measured that bounds
        them); ``ceiling``: as if every draft were kept."""
        accept = 1.0 if ceiling else self.acceptance()
        best = 0.0
        for k in range(1, k_max + 1):
            verify = self._verify.base + k * self._verify.slope
            cost = round_cost(k, self._draft_step.value, rtt_s + verify, accept ** (k + 1))
            if cost <= 0:
                return math.inf
            best = max(best, expected_tokens([accept] * k) / cost)
        return best


__all__ = ["CLOUD_CAP_MARGIN", "FIRST_FLOOR", "LONE_STEPS", "STAGES", "Arm",
           "DraftLengthPolicy", "Ema", "HintGate", "LinearFit", "RoundsEstimate",
           "StrategyChooser", "TreeShape", "expected_tokens", "hint_shape", "relative_speed",
           "round_cost", "stage", "stream_lookahead"]
