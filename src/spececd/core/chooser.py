"""Which way to speculate against a server, chosen from measured speed.

:class:`StrategyChooser` picks, per edge session, between two :class:`Arm` s: rounds
(draft, send, wait) or streaming (the server generates); within rounds, drafting the
next block ahead or not; within streaming, drafts sent as hints or none at all
(cloud-only generation, the server alone, where no drafting pays). The caller reports each
exchange's tokens, seconds and how far into its generation it began; the chooser says
which arm to go on with. Arms are compared over the same stages of generations
(:func:`stage`, :func:`relative_speed`), because text grows more predictable along a
generation. :class:`HintGate` decides, for stream drafting, whether hints still reach
the server in time to be worth sending.

Pure: no clock, no I/O, no model. Everything is fed in tokens and seconds; when a switch
takes effect is the caller's (:mod:`spececd.edge.strategies`). The draft length within a
round is not chosen here but by :class:`~spececd.core.policy.DraftLengthPolicy`.
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field


class Arm(enum.Enum):
    """The ways to speculate against a server that :class:`StrategyChooser` picks from, in
    pairs: rounds or streaming; within rounds, block-ahead or plain; within streaming,
    hints or none (cloud-only generation, the server alone)."""

    ROUNDS = "rounds"  # rounds: draft, send, wait
    STREAM = "stream"  # stream drafting: the server generates, drafts follow as hints
    AHEAD = "block-ahead"  # rounds that draft the next block while the verdict is awaited
    PLAIN = "plain"  # rounds that draft only after the verdict
    CLOUD = "cloud-only"  # the server generates, the edge only reads: no drafting at all


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
    measured over some same stages of generations.

    Text grows more predictable along a generation (at its start the continuation of the
    prompt is least certain), and not every arm gains alike: rounds, whose tokens per
    round follow the draft's acceptance, gain more than streaming, which brings the
    server's own token per step whatever the draft does. So each arm is timed stage by
    stage, where it measured at least ``least`` tokens, and the two are compared on the
    time a generation of the recent mix of stages would take (each stage weighted by the
    tokens both arms generated there, faded). Where only one arm measured a stage, the
    other's time there is its own over the measured one's at the nearest stage both
    measured (the earlier of two as near). With no such stage, the arms' overall speeds."""
    stages = range(len(STAGES) + 1)
    has_a = [n >= least for n in a.measured]
    has_b = [n >= least for n in b.measured]
    both = [i for i in stages if has_a[i] and has_b[i]]
    if not both:
        va, vb = a.value, b.value
        assert va is not None and vb is not None
        return va / vb, False

    def per_token(s: _Speed, i: int) -> float:
        return s.seconds[i] / s.tokens[i]

    ratio = {i: per_token(a, i) / max(per_token(b, i), 1e-12) for i in both}
    time_a = time_b = 0.0
    for i in stages:
        if not (has_a[i] or has_b[i]):
            continue
        near = ratio[min(both, key=lambda j: (abs(j - i), j))]
        ta = per_token(a, i) if has_a[i] else per_token(b, i) * near
        tb = per_token(b, i) if has_b[i] else per_token(a, i) / max(near, 1e-12)
        weight = a.tokens[i] + b.tokens[i]
        time_a, time_b = time_a + weight * ta, time_b + weight * tb
    return time_b / max(time_a, 1e-12), True


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
    as on the link. For the same reason the arms are compared stage by stage of
    generations (:func:`relative_speed`): streaming, probed after rounds, is measured
    later in generations than the rounds it is compared with, measured at their start,
    where text is least predictable and rounds fare worst; so an arm, once switched to, runs
    ``probe_segments`` segments at least, which takes a probe of rounds past a
    generation's first stage.

    A session starts with the first arm and measures the second next, then keeps the
    faster arm (the other must be faster by ``margin`` to take over) and measures the other
    again after ``probe_after`` tokens: a spacing that doubles each time the other arm
    loses again, up to ``max_probe``, and goes straight there when the other was far behind
    (under ``close`` times the leader, over some same stages, from the second comparison
    on). A change of link is noticed late; an arm that is clearly worse costs little.

    What the caller knows without running an arm spares measuring it: an arm whose
    :meth:`cap` (a ceiling, or an estimate from the other arm's measurements) is under the
    other's speed, measured or else its :meth:`floor`, is neither started nor probed while
    that holds, a probe of it staying due until its cap rises. So a session starts with
    the second arm when the first cannot win. A cap never overrides a measurement: it only
    spares one.

    Pure: no clock, no I/O. It says which arm to go on with, at any exchange; when a
    switch takes effect is the caller's (:class:`~spececd.edge.strategies.Adaptive`
    switches at once, a stream included).
    """

    arms: tuple[Arm, Arm] = (Arm.ROUNDS, Arm.STREAM)
    segment: int = 16
    probe_after: int = 64
    max_probe: int = 4096
    close: float = 0.75
    margin: float = 0.05  # a wider one keeps a leader up to that much slower than the other
    decay: float = 0.85
    # Segments an arm runs at least, once switched to: a probe of rounds, which begins a
    # generation, reaches past the generation's first stage, where rounds fare worst.
    probe_segments: int = 2
    # Whether a probe of the arm behind may begin within a generation (arms a generation
    # switches between at any step); False: at the start of one only (rounds against
    # streaming: a probe of rounds measures a generation's start, where rounds fare worst,
    # as streaming, probed after rounds, measures later stages). A leader that falls
    # behind, or a probe that ends, switches at once either way.
    probe_within: bool = False
    _speed: dict[Arm, _Speed] = field(default_factory=dict)
    _last: Arm | None = None  # the arm of the last segment completed
    _run: int = 0  # segments completed by it in a row
    _behind: bool = True  # whether it was behind (or unmeasured) when its run began
    _spacing: int = 0
    _since_probe: int = 0  # tokens generated by the leader since the arm behind was measured
    _probes: int = 0  # comparisons made
    _ceiling: dict[Arm, float] = field(default_factory=dict)  # the most an arm can reach
    _floor: dict[Arm, float] = field(default_factory=dict)  # the least an arm reaches
    _leader: Arm = Arm.ROUNDS

    def __post_init__(self) -> None:
        self._speed = {arm: _Speed(self.decay) for arm in self.arms}
        self._spacing = self._since_probe = self.probe_after  # the first comparison decides
        self._leader = self.arms[0]

    def speed(self, arm: Arm) -> float | None:
        """The measured speed of ``arm`` (its decayed average), or None before it ran."""
        return self._speed[arm].value

    def other(self, arm: Arm) -> Arm:
        """The arm this chooser compares ``arm`` with."""
        first, second = self.arms
        return second if arm is first else first

    def leader(self) -> Arm:
        """The faster arm: the one leading so far, unless the other is faster by more
        than ``margin`` (a hysteresis, so that noise does not swap them back and forth);
        with one arm measured, that one."""
        first, second = self.arms
        if self.speed(first) is None or self.speed(second) is None:
            measured = [arm for arm in self.arms if self.speed(arm) is not None]
            self._leader = measured[0] if measured else first
            return self._leader
        if self.ratio(self.other(self._leader))[0] > 1 + self.margin:
            self._leader = self.other(self._leader)
        return self._leader

    def cap(self, arm: Arm, tokens_per_s: float) -> None:
        """The most tokens per second ``arm`` could reach here, as far as the caller can
        tell without running it (rounds: what the round trip, the server's step and the
        draft's allow; :class:`~spececd.core.policy.RoundsEstimate`): an arm whose cap is
        under the other's speed is not run (:meth:`beaten`)."""
        self._ceiling[arm] = tokens_per_s

    def floor(self, arm: Arm, tokens_per_s: float) -> None:
        """The least tokens per second ``arm`` reaches here (streaming: the server's own
        generation, a token per step), which stands for its speed until it is measured."""
        self._floor[arm] = tokens_per_s

    def beaten(self, arm: Arm) -> bool:
        """Whether ``arm`` cannot win here, by what is known without running it: its cap
        is under the other arm's speed, measured or else its floor."""
        other = self.other(arm)
        known = self.speed(other)
        return self._ceiling.get(arm, math.inf) < (
            known if known is not None else self._floor.get(other, 0.0))

    def ratio(self, arm: Arm) -> tuple[float, bool]:
        """How much faster ``arm`` is than the other (both measured), and whether over the
        same stages of generations."""
        return relative_speed(self._speed[arm], self._speed[self.other(arm)],
                              least=self.segment / 2)

    def start(self) -> Arm:
        """The arm to begin a generation with."""
        for arm in self.arms:
            if self.speed(arm) is None and not self.beaten(arm):
                return arm  # measure both first, in order
        leader = self.leader()
        return self.other(leader) if self._due(self.other(leader)) else leader

    def _due(self, arm: Arm) -> bool:
        """Whether ``arm``, behind, is to be measured now."""
        return self._since_probe >= self._spacing and not self.beaten(arm)

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
        if self._last is arm:
            self._run += 1
        else:  # a new run: the arm behind (or not yet measured) runs as a probe of it
            self._last, self._run, self._behind = arm, 1, before is not arm
        if self.speed(other) is None:  # measure the other arm as well, if it might win
            return arm if self.beaten(other) or self._run < self.probe_segments else other
        if self._run < self.probe_segments:
            return arm
        if self._behind:  # the end of a probe: the arm behind was measured again
            self._behind = False
            if self._since_probe >= self._spacing:
                self._probed()
            return self.leader()
        if self.leader() is not arm:  # the leader fell behind
            return other
        self._since_probe += completed
        return other if self.probe_within and self._due(other) else arm

    def _probed(self) -> None:
        """Both arms were just measured: space the next probe of the one behind out."""
        leader = self.leader()
        behind = self.other(leader)
        ratio, matched = self.ratio(behind)
        # Neither the first comparison (a session's first exchanges run cold) nor one over
        # different stages of generations is sure enough to stop measuring for long. (An
        # arm whose cap is under the leader's speed is not probed while it stays so: a
        # cap that rises, a link grown faster, lets it be probed on the usual spacing.)
        far = matched and ratio < self.close and self._probes > 0
        self._probes += 1
        self._spacing = self.max_probe if far else min(self.max_probe, 2 * self._spacing)
        self._since_probe = 0


@dataclass
class HintGate:
    """Stream drafting: whether hints are worth sending on this link.

    A hint helps only if it reaches the server before the server has generated past it,
    and the server keeps some of it. When the round trip is longer than the server takes
    to generate as many tokens as the edge drafts ahead, every hint arrives late; when the
    draft does not predict the target (a sampled text it cannot follow), every hint is
    verified and thrown away. Either way drafting costs the edge's time, the link's bytes
    and the server's verified positions (on a loaded server, its batch) for nothing. After
    ``patience`` steps in a row in which the server kept no hinted token, the gate closes
    for ``pause`` tokens (the edge only reads, as in cloud-only generation), then opens to
    try again; each fruitless try doubles the pause (up to ``max_pause``), and a kept hint
    resets it. Pure: the caller counts.
    """

    patience: int = 16
    first_pause: int = 32
    max_pause: int = 1024
    _fruitless: int = 0  # steps in a row that kept no hinted token, while hints were sent
    _pause: int = 0  # the current pause's length in tokens
    _closed_for: int = 0  # tokens still to receive before the gate opens

    def __post_init__(self) -> None:
        self._pause = self.first_pause

    @property
    def open(self) -> bool:
        """Whether hints may be sent now: the gate is not closed for a pause."""
        return self._closed_for <= 0

    def step(self, tokens: int, kept: bool, hinted: bool) -> None:
        """Feed one server step: the ``tokens`` it brought, whether it kept a hinted token,
        and whether hints were out when it ran."""
        if not self.open:
            self._closed_for -= tokens
            return
        if kept:
            self._fruitless, self._pause = 0, self.first_pause
        elif hinted:
            self._fruitless += 1
            if self._fruitless >= self.patience:
                self._closed_for, self._fruitless = self._pause, 0
                self._pause = min(self.max_pause, 2 * self._pause)
