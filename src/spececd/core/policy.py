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

import bisect
import enum
import math
from dataclasses import dataclass, field


@dataclass
class Ema:
    """An exponential moving average; the first value is taken as it is."""

    value: float
    weight: float = 0.2
    seen: bool = False

    def update(self, x: float) -> None:
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
        w = self.weight if self.seen else 1.0
        self._x += w * (x - self._x)
        self._y += w * (y - self._y)
        self._xx += w * (x * x - self._xx)
        self._xy += w * (x * y - self._xy)
        self.seen = True

    @property
    def slope(self) -> float:
        variance = self._xx - self._x * self._x
        if variance <= 1e-9 * max(1.0, self._xx):
            return 0.0
        return max(0.0, (self._xy - self._x * self._y) / variance)

    @property
    def base(self) -> float:
        return max(0.0, self._y - self.slope * self._x)


FIRST_FLOOR = 0.1  # a sibling's expected gain before anything is measured


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
                network_s: float, positions: int | None = None) -> None:
        """Feed one round: tokens drafted and accepted, the drafting time, the verifier's
        reported time, and the rest of the round trip; ``positions``: what the verifier
        computed (a tree's nodes; default ``drafted``)."""
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
        if drafted <= 1 or not self._verify_base.seen:
            self._verify_base.update(verify_s)
        else:
            slope = max(0.0, (verify_s - self._verify_base.value) / drafted)
            self._verify_per_token.update(slope)
        if self.rounds > 1:  # the first round's pass also ran over the prompt
            self._verify.update(positions, verify_s)
        self._network.update(max(0.0, network_s))

    def expected_tokens(self, k: int) -> float:
        gain, survive = 1.0, 1.0
        for a in self.acceptance()[:k]:
            survive *= a
            gain += survive
        return gain

    def cost(self, k: int, fitted: bool = False) -> float:
        """Seconds a round of ``k`` costs; ``fitted``: with the least-squares verify model."""
        verify = (self._verify.base + k * self._verify.slope if fitted
                  else self._verify_base.value + k * self._verify_per_token.value)
        round_trip = verify + self._network.value
        drafting = k * self._draft_step.value
        if not self.proactive:
            return drafting + round_trip
        a = self.acceptance()  # past k_max, the bonus guess takes the last estimate
        hit = math.prod(a[min(i, len(a) - 1)] for i in range(k + 1))
        return hit * max(drafting, round_trip) + (1 - hit) * (drafting + round_trip)

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


class Arm(enum.Enum):
    """The ways to speculate against a server that :class:`StrategyChooser` picks from, in
    pairs: rounds or streaming, and within rounds, block-ahead or plain."""

    ROUNDS = "rounds"  # rounds: draft, send, wait
    STREAM = "stream"  # stream drafting: the server generates, drafts follow as hints
    AHEAD = "block-ahead"  # rounds that draft the next block while the verdict is awaited
    PLAIN = "plain"  # rounds that draft only after the verdict


STAGES = (16, 32, 64, 128, 256)  # where a generation's stages end, in tokens generated


def stage(position: int) -> int:
    """The stage of a generation that an exchange starting ``position`` tokens in falls in."""
    return bisect.bisect_right(STAGES, position)


@dataclass
class _Speed:
    """An arm's speed at each stage of a generation: tokens over seconds per stage, all
    sums decaying by ``decay`` per segment either arm completes, so that a long segment
    weighs more than a short one and old segments fade (a probe after a long spell of the
    other arm speaks mostly for now)."""

    decay: float
    tokens: list[float] = field(default_factory=lambda: [0.0] * (len(STAGES) + 1))
    seconds: list[float] = field(default_factory=lambda: [0.0] * (len(STAGES) + 1))
    measured: list[int] = field(default_factory=lambda: [0] * (len(STAGES) + 1))  # unfaded
    segments: int = 0
    partial: dict[int, tuple[int, float]] = field(default_factory=dict)  # stage: the segment
    # under way

    def add(self, position: int, tokens: int, seconds: float, segment: int) -> int:
        """Add an exchange that began ``position`` tokens into its generation; the tokens of
        the segment it completed, or 0."""
        at = stage(position)
        n, t = self.partial.get(at, (0, 0.0))
        self.partial[at] = (n + tokens, t + seconds)
        total = sum(n for n, _ in self.partial.values())
        if total < segment:
            return 0
        self.fade()
        for i, (n, t) in self.partial.items():
            self.tokens[i] += n
            self.seconds[i] += t
            self.measured[i] += n
        self.segments += 1
        self.partial = {}
        return total

    def fade(self) -> None:
        self.tokens = [self.decay * n for n in self.tokens]
        self.seconds = [self.decay * t for t in self.seconds]

    @property
    def value(self) -> float | None:
        seconds = sum(self.seconds)
        return sum(self.tokens) / seconds if self.segments and seconds > 0 else None


def relative_speed(a: _Speed, b: _Speed, least: float) -> tuple[float, bool]:
    """How much faster ``a`` is than ``b`` (a ratio of speeds), and whether it was
    measured over the same stages of generations.

    Text grows more predictable along a generation (at its start the continuation of the
    prompt is least certain), so an arm measured only at the start of generations looks
    slower than one measured over their rest. Each is timed on the token mix the two saw
    together, stage by stage: the seconds per token of ``b`` over those of ``a``, over the
    stages where both have measured at least ``least`` tokens, each weighted by the fewer
    of the two (faded). With no such stage, the arms' overall speeds."""
    weights = [min(na, nb) if min(ca, cb) >= least else 0.0 for na, nb, ca, cb in zip(
        a.tokens, b.tokens, a.measured, b.measured, strict=True)]
    if any(weights):
        def per_token(s: _Speed) -> float:
            return sum(w * t / n for w, t, n in zip(weights, s.seconds, s.tokens, strict=True)
                       if w)
        return per_token(b) / max(per_token(a), 1e-12), True
    va, vb = a.value, b.value
    assert va is not None and vb is not None
    return va / vb, False


@dataclass
class StrategyChooser:
    """Chooses, per edge session, between two ways to speculate (``arms``) from the speed
    each reached here: by default speculating in rounds or stream drafting, and, nested in
    the rounds, drafting the next block ahead or not.

    Rounds pay a network round trip per round; stream drafting pays none (the server
    generates without waiting, like cloud-only generation, and verifies the drafts that
    arrive in time), so it wins as the round trip grows, and rounds win on a fast link.
    Drafting a block ahead hides the draft behind the round trip, but costs drafts that the
    verdict throws away and, where the draft shares its processor with the rest, can slow
    what it overlaps; plain rounds win with a cheap draft. The crossing points depend on
    the link, the draft's speed and acceptance, and the server's step, all of which change;
    so the chooser measures instead of predicting. The caller reports each exchange's
    tokens, the seconds it took, drafting included (what drafting costs is part of what
    the arms differ in), and how far into its generation it began; every ``segment``
    tokens an arm's speed is updated, as tokens over seconds with older segments fading
    (``decay``), since one segment's speed depends as much on how predictable its text was
    as on the link. For the same reason the arms are compared over the same stages of
    generations where both measured half a segment or more (:func:`relative_speed`):
    streaming runs a generation to its end, so the rounds it is compared with are measured
    at the start of generations, where text is least predictable.

    A session starts with the first arm and measures the second next, then keeps the
    faster arm (the other must be faster by ``margin`` to take over) and measures the other
    again after ``probe_after`` tokens: a spacing that doubles each time the other arm
    loses again, up to ``max_probe``, and goes straight there when the other was far behind
    (under ``close`` times the leader, over the same stages, from the second comparison
    on; or, at once, when its ceiling, :meth:`cap`, is under the leader's speed). A change
    of link is noticed late; an arm that is clearly worse costs little.

    Pure: no clock, no I/O. It says which arm to go on with; when a switch takes effect is
    the caller's (stream drafting cannot stop a generation under way, so a switch from it
    waits for the next generation, :meth:`start`).
    """

    arms: tuple[Arm, Arm] = (Arm.ROUNDS, Arm.STREAM)
    segment: int = 16
    probe_after: int = 64
    max_probe: int = 4096
    close: float = 0.75
    margin: float = 0.05  # a wider one keeps a leader up to that much slower than the other
    decay: float = 0.85
    _speed: dict[Arm, _Speed] = field(default_factory=dict)
    _spacing: int = 0
    _since_probe: int = 0  # tokens generated by the leader since the arm behind was measured
    _probes: int = 0  # comparisons made
    _ceiling: dict[Arm, float] = field(default_factory=dict)  # the most an arm can reach
    _leader: Arm = Arm.ROUNDS

    def __post_init__(self) -> None:
        self._speed = {arm: _Speed(self.decay) for arm in self.arms}
        self._spacing = self._since_probe = self.probe_after  # the first comparison decides
        self._leader = self.arms[0]

    def speed(self, arm: Arm) -> float | None:
        return self._speed[arm].value

    def other(self, arm: Arm) -> Arm:
        first, second = self.arms
        return second if arm is first else first

    def leader(self) -> Arm:
        """The faster arm: the one leading so far, unless the other is faster by more
        than ``margin`` (a hysteresis, so that noise does not swap them back and forth)."""
        first, second = self.arms
        if self.speed(first) is None or self.speed(second) is None:
            self._leader = first if self.speed(first) is None else second
            return self._leader
        if self.ratio(self.other(self._leader))[0] > 1 + self.margin:
            self._leader = self.other(self._leader)
        return self._leader

    def cap(self, arm: Arm, tokens_per_s: float) -> None:
        """The most tokens per second ``arm`` could reach here (rounds: a round's most
        tokens over the round trip): an arm whose ceiling is under the leader's speed is
        as far behind as can be."""
        self._ceiling[arm] = tokens_per_s

    def ratio(self, arm: Arm) -> tuple[float, bool]:
        """How much faster ``arm`` is than the other (both measured), and whether over the
        same stages of generations."""
        return relative_speed(self._speed[arm], self._speed[self.other(arm)],
                              least=self.segment / 2)

    def start(self) -> Arm:
        """The arm to begin a generation with."""
        for arm in self.arms:
            if self.speed(arm) is None:
                return arm  # measure both first, in order
        leader = self.leader()
        if self._since_probe >= self._spacing:  # the arm behind is due to be measured
            return self.other(leader)
        return leader

    def record(self, arm: Arm, tokens: int, seconds: float, position: int = 0) -> Arm:
        """Feed an exchange ``arm`` ran: the tokens it brought, the seconds it took and the
        tokens its generation had before it; return the arm to go on with."""
        other = self.other(arm)
        both = self.speed(arm) is not None and self.speed(other) is not None
        before = self.leader() if both else None
        # An exchange that brought nothing (a hint sent) still took its time.
        completed = self._speed[arm].add(position, max(0, tokens), max(0.0, seconds),
                                         self.segment)
        if not completed:
            return arm
        self._speed[other].fade()
        if self.speed(other) is None:
            return other  # measure the other arm as well, before choosing
        if before is not arm:  # the arm behind ran: it is measured again
            if self._since_probe >= self._spacing:  # once per probe (a stream runs on)
                self._probed()
            return self.leader()
        if self.leader() is not arm:  # the leader fell behind
            return other
        self._since_probe += completed
        return other if self._since_probe >= self._spacing else arm

    def _probed(self) -> None:
        """Both arms were just measured: space the next probe of the one behind out."""
        leader = self.leader()
        behind = self.other(leader)
        ratio, matched = self.ratio(behind)
        # Neither the first comparison (a session's first exchanges run cold) nor one over
        # different stages of generations is sure enough to stop measuring for long; an
        # arm that cannot reach the leader's speed is.
        far = (matched and ratio < self.close and self._probes > 0) or (
            self._ceiling.get(behind, math.inf) < (self.speed(leader) or 0.0))
        self._probes += 1
        self._spacing = self.max_probe if far else min(self.max_probe, 2 * self._spacing)
        self._since_probe = 0


@dataclass
class HintGate:
    """Stream drafting: whether hints are worth sending on this link.

    A hint helps only if it reaches the server before the server has generated past it.
    When the round trip is longer than the server takes to generate as many tokens as
    the edge drafts ahead, every hint arrives late: drafting then costs the edge's time
    and the link's bytes for nothing. After ``patience`` steps in a row in which the
    server verified no hint, the gate closes for ``pause`` tokens (the edge only reads,
    as in cloud-only generation), then opens to try again; each fruitless try doubles the
    pause (up to ``max_pause``), and a verified hint resets it. Pure: the caller counts.
    """

    patience: int = 16
    first_pause: int = 32
    max_pause: int = 1024
    _fruitless: int = 0  # steps in a row that verified no hint, while hints were sent
    _pause: int = 0  # the current pause's length in tokens
    _closed_for: int = 0  # tokens still to receive before the gate opens

    def __post_init__(self) -> None:
        self._pause = self.first_pause

    @property
    def open(self) -> bool:
        return self._closed_for <= 0

    def step(self, tokens: int, verified: bool, hinted: bool) -> None:
        """Feed one server step: the ``tokens`` it brought, whether it verified hints, and
        whether hints were out when it ran."""
        if not self.open:
            self._closed_for -= tokens
            return
        if verified:
            self._fruitless, self._pause = 0, self.first_pause
        elif hinted:
            self._fruitless += 1
            if self._fruitless >= self.patience:
                self._closed_for, self._fruitless = self._pause, 0
                self._pause = min(self.max_pause, 2 * self._pause)
