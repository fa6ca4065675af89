"""The adaptive draft-length policy: exact cases on fed measurements."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from spececd.core.policy import (
    LONE_STEPS,
    Arm,
    DraftLengthPolicy,
    HintGate,
    LinearFit,
    RoundsEstimate,
    StrategyChooser,
    stream_lookahead,
)


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


def test_the_verify_fit_finds_the_cost_per_position_and_skips_the_prefill() -> None:
    rng = random.Random(1)
    fit = LinearFit()
    for _ in range(200):
        positions = rng.randint(1, 12)
        fit.update(positions, 0.005 + 0.001 * positions + rng.gauss(0, 0.0002))
    assert fit.slope == pytest.approx(0.001, rel=0.1)
    assert fit.base == pytest.approx(0.005, rel=0.1)
    policy = DraftLengthPolicy(k_max=8)
    policy.observe(4, 2, 0.004, 0.5, 0.0, positions=4)  # the first pass: the prompt too
    for positions in (2, 6) * 10:
        policy.observe(positions, 1, 0.004, 0.005 + 0.001 * positions, 0.0, positions)
    assert policy._verify.slope == pytest.approx(0.001, rel=0.01)  # the 0.5 s pass left out
    assert policy._verify.base == pytest.approx(0.005, rel=0.01)


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


# -- the strategy chooser (--proactive auto) ------------------------------------------


PROBE = StrategyChooser().probe_segments  # segments an arm runs at least once switched to


def simulate(chooser: StrategyChooser, speed: dict[Arm, float], generations: int,
             tokens: int = 64, easier: float | dict[Arm, float] = 0.0,
             noise: random.Random | None = None) -> list[tuple[Arm, int]]:
    """Generations of ``tokens`` each, every segment generated at ``speed[arm]`` tokens per
    second (a function of the link, as the chooser sees it), times ``1 + easier`` (the
    arm's, if by arm) for each segment already generated (text that grows more
    predictable along a generation), and, with ``noise``, off by up to 20% either way;
    (arm, tokens) per segment."""
    gain = easier if isinstance(easier, dict) else dict.fromkeys(speed, easier)
    segments = []
    for _ in range(generations):
        arm, done = chooser.start(), 0
        while done < tokens:
            n = min(chooser.segment, tokens - done)
            segments.append((arm, n))
            pace = speed[arm] * (1 + gain[arm] * (done // chooser.segment))
            pace *= noise.uniform(0.8, 1.2) if noise is not None else 1.0
            following = chooser.record(arm, n, n / pace, position=done)
            done += n
            arm = following  # a switch takes effect at once, from streaming too
    return segments


def arms(segments: list[tuple[Arm, int]]) -> list[Arm]:
    return [arm for arm, _ in segments]


def share(segments: list[tuple[Arm, int]], arm: Arm) -> float:
    return sum(n for a, n in segments if a is arm) / sum(n for _, n in segments)


def test_a_slow_link_settles_on_streaming_and_rarely_probes_rounds() -> None:
    chooser = StrategyChooser()
    segments = simulate(chooser, {Arm.ROUNDS: 40.0, Arm.STREAM: 100.0}, generations=100)
    assert arms(segments)[:PROBE + 1] == [Arm.ROUNDS] * PROBE + [Arm.STREAM]  # tried both
    later = segments[8:]
    assert share(later, Arm.STREAM) > 0.98  # rounds far behind: probed at most spacing
    assert chooser.leader() is Arm.STREAM


def test_a_fast_link_settles_on_rounds_and_probes_a_close_stream_ever_less_often() -> None:
    chooser = StrategyChooser()
    segments = simulate(chooser, {Arm.ROUNDS: 120.0, Arm.STREAM: 100.0}, generations=200)
    assert chooser.leader() is Arm.ROUNDS
    assert share(segments, Arm.ROUNDS) > 0.9
    probes = [i for i, (arm, _) in enumerate(segments) if arm is Arm.STREAM]
    gaps = [b - a for a, b in itertools.pairwise(probes) if b - a > 1]
    assert gaps == sorted(gaps) and gaps[-1] > 4 * gaps[0]  # spaced out, doubling


def test_arms_are_compared_over_the_same_stages_of_generations() -> None:
    # Rounds are faster at every stage, but text gets easier along a generation, and
    # streaming, probed after rounds, is timed later in generations: compared on speeds
    # alone, streaming would look faster than rounds (timed at their starts).
    chooser, speed = StrategyChooser(), {Arm.ROUNDS: 120.0, Arm.STREAM: 100.0}
    segments = simulate(chooser, speed, generations=1, easier=0.5)
    # The first generation (4 segments): rounds, then streaming probed, which over
    # different stages looks faster, so the second generation starts with it.
    assert arms(segments) == [Arm.ROUNDS] * PROBE + [Arm.STREAM] * PROBE
    assert (chooser.speed(Arm.STREAM) or 0) > 1.15 * (chooser.speed(Arm.ROUNDS) or 0)
    assert chooser.start() is Arm.STREAM
    # Its first segment, at stage 0, shows rounds faster there: back to rounds at once.
    segments = simulate(chooser, speed, generations=1, easier=0.5)
    assert arms(segments) == [Arm.STREAM] + [Arm.ROUNDS] * 3
    assert chooser.ratio(Arm.ROUNDS) == (pytest.approx(1.2), True)  # stage 0 against stage 0
    assert chooser.leader() is Arm.ROUNDS
    segments = simulate(chooser, speed, generations=40, easier=0.5)
    assert share(segments, Arm.ROUNDS) > 0.9


def test_rounds_slower_at_a_generations_start_but_faster_over_it_win() -> None:
    # Measured at RTT 0 with the ONNX draft: at a generation's start rounds bring a token
    # or two each (the draft cannot yet follow), streaming the server's own steps; later
    # rounds bring 4-9. Here rounds are 0.7 of streaming over the first stage and 1.11
    # times it over a whole generation. A probe of rounds that ended with the first stage
    # would compare that stage alone, and keep streaming.
    speed, easier = {Arm.ROUNDS: 70.0, Arm.STREAM: 100.0}, {Arm.ROUNDS: 1.5, Arm.STREAM: 0.3}
    chooser = StrategyChooser()
    segments = simulate(chooser, speed, generations=40, easier=easier)
    assert chooser.leader() is Arm.ROUNDS and share(segments[8:], Arm.ROUNDS) > 0.9
    short = StrategyChooser(probe_segments=1)
    segments = simulate(short, speed, generations=40, easier=easier)
    assert short.leader() is Arm.STREAM and share(segments[8:], Arm.STREAM) > 0.9


def test_a_stage_counts_only_when_both_arms_measured_half_a_segment_there() -> None:
    chooser = StrategyChooser()
    chooser.record(Arm.ROUNDS, 16, 0.2, position=0)  # stage 0
    chooser.record(Arm.STREAM, 4, 0.01, position=12)  # 4 tokens in stage 0, too few
    chooser.record(Arm.STREAM, 12, 0.1, position=16)
    assert chooser.ratio(Arm.STREAM) == (pytest.approx((16 / 0.11) / (16 / 0.2)), False)
    chooser.record(Arm.STREAM, 6, 0.06, position=4)  # now 10 there (the older 4 faded)
    chooser.record(Arm.STREAM, 10, 0.1, position=40)
    stream_s = (0.85 * 0.01 + 0.06) / (0.85 * 4 + 6)  # per token in stage 0
    assert chooser.ratio(Arm.STREAM) == (pytest.approx((0.2 / 16) / stream_s), True)


def test_one_cold_comparison_does_not_stop_the_probes_for_long() -> None:
    chooser = StrategyChooser()
    chooser.record(Arm.ROUNDS, 16, 16 / 30.0)  # a session's first exchanges, cold
    simulate(chooser, {Arm.ROUNDS: 120.0, Arm.STREAM: 100.0}, generations=1)
    assert chooser.leader() is Arm.STREAM  # rounds far behind, by the first measurement
    segments = simulate(chooser, {Arm.ROUNDS: 120.0, Arm.STREAM: 100.0}, generations=12)
    assert chooser.leader() is Arm.ROUNDS and segments[-1][0] is Arm.ROUNDS


def test_rounds_that_cannot_reach_streaming_are_not_probed_again_for_long() -> None:
    # 100 ms round trips, 8 tokens at most a round: 80 tokens/s at best, under streaming's
    # 95. The first comparison (over different stages) is then sure enough.
    speed = {Arm.ROUNDS: 33.0, Arm.STREAM: 95.0}
    capped = StrategyChooser()
    capped.cap(Arm.ROUNDS, 80.0)
    segments = simulate(capped, speed, generations=40)
    assert arms(segments).count(Arm.ROUNDS) == PROBE
    uncapped = simulate(StrategyChooser(), speed, generations=40)
    assert arms(uncapped).count(Arm.ROUNDS) == 2 * PROBE  # a second probe


def test_rounds_that_cannot_reach_the_servers_own_speed_are_not_started() -> None:
    # What the edge knew at the hello (the round trip, the server's step, the draft's)
    # caps rounds under what the server generates alone, which streaming reaches at least:
    # a session streams from its first generation and never measures rounds.
    chooser = StrategyChooser()
    chooser.cap(Arm.ROUNDS, 80.0)
    chooser.floor(Arm.STREAM, 90.0)
    segments = simulate(chooser, {Arm.ROUNDS: 33.0, Arm.STREAM: 95.0}, generations=20)
    assert set(arms(segments)) == {Arm.STREAM}
    assert chooser.speed(Arm.ROUNDS) is None and chooser.leader() is Arm.STREAM
    # A cap over that floor, or none known: rounds first, then streaming, as ever.
    for floor in (70.0, 0.0):
        chooser = StrategyChooser()
        chooser.cap(Arm.ROUNDS, 80.0)
        chooser.floor(Arm.STREAM, floor)
        segments = simulate(chooser, {Arm.ROUNDS: 33.0, Arm.STREAM: 95.0}, generations=1)
        assert arms(segments)[:PROBE + 1] == [Arm.ROUNDS] * PROBE + [Arm.STREAM]


def test_a_probe_of_rounds_waits_while_their_estimate_is_under_streaming() -> None:
    # Rounds at 0.7 of streaming. Measured, they are probed a second time (a session's
    # first comparison runs cold); estimated from what streaming measures, under its
    # speed, they are not: each probe would cost a segment of rounds and a new stream.
    speed = {Arm.ROUNDS: 70.0, Arm.STREAM: 100.0}
    assert arms(simulate(StrategyChooser(), speed, generations=40)).count(Arm.ROUNDS) == \
        2 * PROBE
    chooser = StrategyChooser()
    simulate(chooser, speed, generations=1)  # both measured in the first generation
    chooser.cap(Arm.ROUNDS, 90.0)
    assert Arm.ROUNDS not in arms(simulate(chooser, speed, generations=40))
    # The link grows faster, and so does the estimate: the probe, due all along, runs at
    # the next generation's start (not 4,096 tokens later), and rounds take over.
    chooser.cap(Arm.ROUNDS, 200.0)
    segments = simulate(chooser, {Arm.ROUNDS: 150.0, Arm.STREAM: 100.0}, generations=3)
    assert arms(segments)[0] is Arm.ROUNDS and chooser.leader() is Arm.ROUNDS
    assert arms(segments)[-4:] == [Arm.ROUNDS] * 4


def test_a_cap_spares_a_measurement_but_never_overrides_one() -> None:
    speed = {Arm.ROUNDS: 120.0, Arm.STREAM: 100.0}
    capped, free = StrategyChooser(), StrategyChooser()
    for chooser in (capped, free):
        simulate(chooser, speed, generations=4)
    assert capped.leader() is Arm.ROUNDS
    capped.cap(Arm.ROUNDS, 90.0)  # an estimate under streaming's speed, and wrong
    segments = simulate(capped, speed, generations=20)
    assert capped.leader() is Arm.ROUNDS and segments == simulate(free, speed, generations=20)


@pytest.mark.parametrize("seed", range(10))
def test_with_jitter_rounds_slower_than_streaming_are_not_probed_again(seed: int) -> None:
    # "RTT 0" with 10 ms of jitter (docs/benchmarks-2026-11-22-late.md): block-ahead rounds
    # at 132 tokens/s, streaming at 186, every segment off by up to 20%. Without an
    # estimate, a noisy second comparison can find rounds closer than three quarters of
    # streaming and keep probing them, ever more rarely; with the estimate (which errs
    # for rounds, but stays under streaming) they run in the first generations only (the
    # first comparison, over different stages, may let them lead a generation more).
    speed = {Arm.ROUNDS: 132.0, Arm.STREAM: 186.0}
    chooser = StrategyChooser()
    chooser.cap(Arm.ROUNDS, 160.0)
    segments = simulate(chooser, speed, generations=40, noise=random.Random(seed))
    assert Arm.ROUNDS not in arms(segments)[8:] and chooser.leader() is Arm.STREAM


def test_a_link_that_changes_is_followed() -> None:
    chooser = StrategyChooser(max_probe=512)
    simulate(chooser, {Arm.ROUNDS: 120.0, Arm.STREAM: 100.0}, generations=20)
    assert chooser.leader() is Arm.ROUNDS
    # The link slows down: rounds lose their lead at once (they are what runs).
    simulate(chooser, {Arm.ROUNDS: 30.0, Arm.STREAM: 100.0}, generations=5)
    assert chooser.leader() is Arm.STREAM
    # It speeds up again: found by the next probe of rounds, due within max_probe tokens.
    due = (chooser._spacing - chooser._since_probe) // chooser.segment
    segments = simulate(chooser, {Arm.ROUNDS: 150.0, Arm.STREAM: 100.0}, generations=60)
    assert chooser.leader() is Arm.ROUNDS
    assert [arm for arm, _ in segments[:due + 8]].count(Arm.ROUNDS) >= 4
    # Streaming, far behind, is probed once per max_probe tokens: a 64-token generation
    # per 512 tokens of rounds.
    assert share(segments[-80:], Arm.ROUNDS) > 0.85


def test_within_rounds_the_faster_kind_wins_and_switches_take_effect_at_once() -> None:
    chooser = StrategyChooser(arms=(Arm.AHEAD, Arm.PLAIN), probe_within=True)
    segments = simulate(chooser, {Arm.AHEAD: 100.0, Arm.PLAIN: 107.0}, generations=40)
    assert arms(segments)[:PROBE + 1] == [Arm.AHEAD] * PROBE + [Arm.PLAIN]  # mid-generation
    assert chooser.leader() is Arm.PLAIN and share(segments[8:], Arm.PLAIN) > 0.9
    # 7% is inside a margin of 10%: no takeover there.
    wide = StrategyChooser(arms=(Arm.AHEAD, Arm.PLAIN), margin=0.1, probe_within=True)
    simulate(wide, {Arm.AHEAD: 100.0, Arm.PLAIN: 107.0}, generations=40)
    assert wide.leader() is Arm.AHEAD


# -- auto as a whole: rounds or the server generating, with hints or without -----------


@dataclass
class Auto:
    """The three choosers of ``--proactive auto`` as the edge nests them
    (:class:`~spececd.edge.strategies.Adaptive`): rounds or streaming; within rounds,
    block-ahead or plain, switched at once; within streaming, hints or none (cloud-only
    generation), switched at once too (the server's generation goes on either way). A
    switch between rounds and streaming takes effect at once too (a stream left is
    requested anew when streaming comes back)."""

    outer: StrategyChooser = field(default_factory=StrategyChooser)
    kinds: StrategyChooser = field(
        default_factory=lambda: StrategyChooser(arms=(Arm.AHEAD, Arm.PLAIN), probe_within=True))
    hints: StrategyChooser = field(
        default_factory=lambda: StrategyChooser(arms=(Arm.STREAM, Arm.CLOUD), probe_within=True))
    # What streaming measures of the server's steps, which caps the server alone as the
    # edge caps it (RoundsEstimate.cloud_cap, before each exchange of streaming).
    steps: RoundsEstimate = field(default_factory=RoundsEstimate)

    def run(self, speed: Callable[[int, int], dict[Arm, float]], generations: int,
            tokens: int = 64, estimate: float = 1.4, hinted: tuple[int, float] | None = None
            ) -> list[tuple[Arm, int, float]]:
        """Generations of ``tokens``, each segment at ``speed(generation, position)[arm]``
        tokens per second for the way that ran it (PLAIN, AHEAD, STREAM with hints, CLOUD
        without): (way, tokens, seconds) per segment. Once rounds ran, the client caps
        them at ``estimate`` times their speed (:class:`RoundsEstimate`, from what they
        kept, errs that much for them). The server's steps go to :attr:`steps`: without
        hints a token a step at the server alone's speed, with hints ``hinted`` (hinted
        positions each step verified, its seconds; by default 4, in 1.5 lone steps), each
        bringing as many tokens as make hints' speed."""
        out = []
        for g in range(generations):
            if any(way in (Arm.PLAIN, Arm.AHEAD) for way, _, _ in out):
                self.outer.cap(Arm.ROUNDS, estimate * max(speed(g, 0)[Arm.PLAIN],
                                                          speed(g, 0)[Arm.AHEAD]))
            arm, kind, hint, done = self.outer.start(), self.kinds.start(), None, 0
            while done < tokens:
                if arm is Arm.STREAM and hint is None:
                    hint = self.hints.start()  # a stream, requested
                way = kind if arm is Arm.ROUNDS else hint
                assert way is not None
                n = min(self.outer.segment, tokens - done)
                now = speed(g, done)
                seconds = n / now[way]
                if arm is Arm.STREAM:
                    self.hints.cap(Arm.CLOUD, self.steps.cloud_cap())
                    self.serve(way, n, now, hinted)
                out.append((way, n, seconds))
                following = self.outer.record(arm, n, seconds, position=done)
                if arm is Arm.ROUNDS:
                    kind = self.kinds.record(kind, n, seconds, position=done)
                else:
                    hint = self.hints.record(hint, n, seconds)  # not by stage
                if following is not arm:
                    arm, hint = following, None  # at once (a stream left, or requested)
                done += n
        return out

    def serve(self, way: Arm, n: int, speed: dict[Arm, float],
              hinted: tuple[int, float] | None) -> None:
        """Feed :attr:`steps` the server's steps that generated ``n`` tokens ``way``."""
        lone = 1 / speed[Arm.CLOUD]
        if way is Arm.CLOUD:
            for _ in range(n):
                self.steps.step(0, 0, lone)
            return
        depth, step_s = hinted or (4, 1.5 * lone)
        per_step = min(depth + 1.0, max(1.0, speed[Arm.STREAM] * step_s))
        for _ in range(math.ceil(n / per_step)):
            self.steps.step(depth, round(per_step) - 1, step_s)


def seconds(segments: list[tuple[Arm, int, float]]) -> float:
    return sum(s for _, _, s in segments)


def ways(segments: list[tuple[Arm, int, float]]) -> list[Arm]:
    return [way for way, _, _ in segments]


# GGUF target (a 2.6 ms step) at RTT 20 ms: every hint arrives stale and costs the server a
# little, rounds pay the round trip each (measured: rounds 0.40 of cloud-only, stream
# drafting 0.90-0.99).
GGUF_20 = {Arm.PLAIN: 134.0, Arm.AHEAD: 131.0, Arm.STREAM: 310.0, Arm.CLOUD: 335.0}


def test_where_no_drafting_pays_auto_runs_at_cloud_onlys_rate() -> None:
    # Without the server alone among its choices, auto streamed at stream drafting's
    # 0.93 of cloud-only at best; now it reads (after measuring the others once) at
    # cloud-only's rate, over a benchmark's worth of tokens (14 generations of 64) and
    # more so over a session.
    auto = Auto()
    segments = auto.run(lambda g, p: GGUF_20, generations=14)
    warm = 2 * 4  # a benchmark's warm-up pass: two generations of four segments
    cloud = 12 * 64 / GGUF_20[Arm.CLOUD]
    assert cloud / seconds(segments[warm:]) > 0.97
    assert auto.outer.leader() is Arm.STREAM and auto.hints.leader() is Arm.CLOUD
    later = auto.run(lambda g, p: GGUF_20, generations=100)
    assert 100 * 64 / GGUF_20[Arm.CLOUD] / seconds(later) > 0.98
    assert ways(later).count(Arm.CLOUD) > 0.95 * len(later)


def test_auto_keeps_up_with_the_best_of_its_choices_at_every_rtt() -> None:
    # Speeds in the shape of the default pair's at RTT 0, 20 and 50 ms (rounds fastest at
    # 0; stream drafting from 20 on), a whole benchmark's worth of tokens: auto pays for
    # measuring, but stays within 10% of the best fixed way, and never under cloud-only.
    for speed in ({Arm.PLAIN: 150.0, Arm.AHEAD: 140.0, Arm.STREAM: 120.0, Arm.CLOUD: 80.0},
                  {Arm.PLAIN: 85.0, Arm.AHEAD: 90.0, Arm.STREAM: 105.0, Arm.CLOUD: 75.0},
                  {Arm.PLAIN: 50.0, Arm.AHEAD: 52.0, Arm.STREAM: 80.0, Arm.CLOUD: 70.0}):
        segments = Auto().run(lambda g, p, speed=speed: speed, generations=14)
        rate = 12 * 64 / seconds(segments[8:])  # after the warm-up pass
        assert rate > 0.9 * max(speed.values()) and rate > speed[Arm.CLOUD]


def test_the_server_alone_is_measured_where_every_hinted_step_verifies_as_many() -> None:
    # Hints always topped up on a fast link: every step verifies 4 hinted positions in
    # 20 ms (70 tokens/s), while the server alone steps in 5 ms (200 tokens/s). With no
    # spread in the positions verified, the verify fit's base is the hinted step: as the
    # server alone's step it capped the server alone at 1.25 x 50 tokens/s, under hints'
    # 70, and auto never measured it, staying at 0.35 of cloud-only (the cap never spares
    # a measurement of it until a step without hints measured the server alone).
    speed = {Arm.PLAIN: 30.0, Arm.AHEAD: 30.0, Arm.STREAM: 70.0, Arm.CLOUD: 200.0}
    auto = Auto()
    segments = auto.run(lambda g, p: speed, generations=14, hinted=(4, 0.020))
    assert 12 * 64 / seconds(segments[8:]) > 0.9 * speed[Arm.CLOUD]
    assert auto.steps.cloud_only() == pytest.approx(200.0)
    assert auto.hints.leader() is Arm.CLOUD


def test_hints_that_stop_paying_are_dropped_mid_generation() -> None:
    # Streaming with hints at 1.4 times the server alone, until, in the fourth
    # generation's middle, the draft stops following the text: hints then cost the
    # server, and the edge stops sending them within that generation, without waiting
    # for the next one (the server's generation goes on either way).
    def speed(g: int, position: int) -> dict[Arm, float]:
        late = (g, position) >= (3, 32) and g < 6
        return {Arm.PLAIN: 40.0, Arm.AHEAD: 40.0, Arm.STREAM: 60.0 if late else 140.0,
                Arm.CLOUD: 100.0}

    auto = Auto(hints=StrategyChooser(arms=(Arm.STREAM, Arm.CLOUD), max_probe=256,
                                      probe_within=True))
    segments = auto.run(speed, generations=14, tokens=64)
    fourth = segments[3 * 4:4 * 4]  # four 16-token segments a generation
    assert ways(fourth)[:2] == [Arm.STREAM, Arm.STREAM]
    assert Arm.CLOUD in ways(fourth)[2:]
    assert ways(segments[4 * 4:6 * 4]).count(Arm.CLOUD) >= 6  # and stays there meanwhile
    # The draft follows again: hints are back by the next probe (max_probe tokens on),
    # and the probes of cloud-only that follow are spaced out again.
    assert auto.hints.leader() is Arm.STREAM
    assert ways(segments[-20:]).count(Arm.STREAM) >= 16


def test_stream_drafting_drafts_past_where_the_server_will_be() -> None:
    assert stream_lookahead(8, 0.0, 0.01, 64) == 8  # no round trip measured yet
    assert stream_lookahead(8, 0.05, 0.0, 64) == 8  # no server step measured yet
    assert stream_lookahead(8, 0.05, 0.01, 64) == 13  # 5 tokens generated meanwhile
    assert stream_lookahead(8, 0.001, 0.01, 64) == 9  # a part of a step is a step
    assert stream_lookahead(8, 0.6, 0.01, 64) == 64  # no longer than the server takes
    assert stream_lookahead(8, 1.0, 0.01, 64) == 0  # all of it stale on arrival: none


def test_a_segment_counts_its_tokens_over_all_its_time() -> None:
    chooser = StrategyChooser()
    assert chooser.record(Arm.ROUNDS, 0, 0.05) is Arm.ROUNDS  # no token, but time
    assert chooser.record(Arm.ROUNDS, 15, 0.1) is Arm.ROUNDS  # not a segment yet
    assert chooser.speed(Arm.ROUNDS) is None and chooser.start() is Arm.ROUNDS
    assert chooser.record(Arm.ROUNDS, 1, 0.05) is Arm.ROUNDS  # 16 tokens: a segment
    assert chooser.speed(Arm.ROUNDS) == pytest.approx(80.0)
    assert chooser.record(Arm.ROUNDS, 16, 0.2, position=16) is Arm.STREAM  # past stage 0


# -- what rounds would bring, from what stream drafting measures -----------------------


def rounds_reference(k_max: int, rtt_s: float, step_s: float, position_s: float,
                     draft_s: float, accept: float) -> float:
    """Tokens per second of the best rounds of at most ``k_max``, from the cost model
    written out: block-ahead rounds, whose drafting hides behind the round trip when all
    ``k`` drafts and the guessed bonus are kept."""
    def speed(k: int) -> float:
        gained = sum(accept ** i for i in range(k + 1))
        drafting, round_trip = k * draft_s, rtt_s + step_s + k * position_s
        hit = accept ** (k + 1)
        return gained / (hit * max(drafting, round_trip) + (1 - hit) * (drafting + round_trip))
    return max(speed(k) for k in range(1, k_max + 1))


def test_the_rounds_estimate_reads_stream_drafting_steps() -> None:
    estimate = RoundsEstimate()
    assert estimate.speed(8, 0.0) == math.inf and estimate.cloud_only() == 0.0
    assert estimate.speed(8, 0.1) == pytest.approx(90.0)  # k_max + 1 tokens per round trip
    for _ in range(200):
        estimate.step(0, 0, 0.010)  # a cloud-only step: 10 ms
        estimate.step(4, 2, 0.014)  # 4 hinted tokens verified, 1 ms each; 2 kept
        estimate.drafted(3, 0.003)
    assert estimate.cloud_only() == pytest.approx(100.0)
    # Kept over reached (the third was reached, the fourth not): 2/3, not 2/4.
    assert estimate.acceptance() == pytest.approx(2 / 3, abs=0.005)
    for rtt in (0.0, 0.02, 0.1):
        assert estimate.speed(8, rtt) == pytest.approx(
            rounds_reference(8, rtt, 0.010, 0.001, 0.001, estimate.acceptance()))
        assert estimate.speed(8, rtt, ceiling=True) == pytest.approx(
            rounds_reference(8, rtt, 0.010, 0.001, 0.001, 1.0))
    # On a fast link rounds would beat the server alone; over 50 ms they could not.
    assert estimate.speed(8, 0.0) > estimate.cloud_only() > estimate.speed(8, 0.05)


def test_the_server_alone_is_read_off_steps_that_verified_no_hint() -> None:
    # Every step verified 4 hinted positions in 20 ms: nothing says what a step without
    # hints takes (the fit's base, with no spread to extrapolate from, is the hinted step,
    # 50 tokens/s), so the server alone is not capped; one lone step of 5 ms caps it at
    # 1.25 times 200 tokens/s.
    estimate = RoundsEstimate()
    for _ in range(200):
        estimate.step(4, 1, 0.020)
    assert estimate.cloud_only() == 0.0 and estimate.cloud_cap() == math.inf
    # A lone step slowed by load (30 ms) caps nothing on its own (it would cap the server
    # alone at 42 tokens/s, under hints' 70); half of LONE_STEPS do, by the fastest.
    estimate.step(0, 0, 0.030)
    assert estimate.cloud_cap() == math.inf
    for _ in range(LONE_STEPS // 2 - 1):
        assert estimate.cloud_cap() == math.inf
        estimate.step(0, 0, 0.005)
    assert estimate.cloud_cap() == pytest.approx(1.25 * 200.0)
    assert 90 < estimate.cloud_only() < 110  # the typical lone step: the slow one weighs


def test_the_rounds_estimate_follows_the_hints_acceptance() -> None:
    estimate = RoundsEstimate()
    rng = random.Random(0)
    for _ in range(400):
        drafted, kept = rng.randint(1, 4), 0
        while kept < drafted and rng.random() < 0.6:
            kept += 1
        estimate.step(drafted, kept, 0.01)
    assert estimate.acceptance() == pytest.approx(0.6, abs=0.06)
    for _ in range(400):  # the text grows predictable: every hint kept
        estimate.step(4, 4, 0.01)
    assert estimate.acceptance() > 0.99


def test_rounds_that_ran_bound_their_own_estimate_where_hints_were_never_verified() -> None:
    # The GGUF target at 20 ms: every hint arrives after the server passed it, so steps
    # verify none, and the hints leave the acceptance at its prior (every draft kept):
    # rounds would seem to bring k_max + 1 tokens a round trip, well over the server alone,
    # and be probed again and again. Once rounds ran, what they kept counts.
    estimate = RoundsEstimate()
    for _ in range(100):
        estimate.step(0, 0, 0.0026)  # cloud-only steps of 2.6 ms: 385 tokens/s
    assert estimate.acceptance() == 1.0
    assert estimate.speed(8, 0.02) > estimate.cloud_only()
    for _ in range(20):  # rounds of 8 drafts keeping 2 (a round's own token besides)
        estimate.round(8, 2)
    assert estimate.acceptance() == pytest.approx(42 / 62, abs=0.02)  # kept / reached
    assert estimate.speed(8, 0.02) < 0.5 * estimate.cloud_only()


# -- the hint gate (stream drafting) ----------------------------------------------------


def test_hints_the_server_never_keeps_stop_for_ever_longer() -> None:
    gate = HintGate(patience=4, first_pause=10, max_pause=40)
    pauses = []
    for _ in range(4):
        for _ in range(4):
            assert gate.open
            gate.step(1, kept=False, hinted=True)
        closed = 0
        while not gate.open:
            gate.step(1, kept=False, hinted=False)  # the edge only reads
            closed += 1
        pauses.append(closed)
    assert pauses == [10, 20, 40, 40]


def test_a_kept_hint_keeps_the_gate_open_and_resets_the_pause() -> None:
    gate = HintGate(patience=4, first_pause=10)
    for i in range(100):  # one step in four keeps a hint: never four fruitless in a row
        gate.step(1, kept=i % 4 == 0, hinted=True)
        assert gate.open
    for _ in range(4):
        gate.step(1, kept=False, hinted=True)
    assert not gate.open
    gate.step(10, kept=False, hinted=False)
    assert gate.open
    for _ in range(3):  # steps without hints out do not count against them
        gate.step(1, kept=False, hinted=False)
    gate.step(1, kept=True, hinted=True)
    for _ in range(4):
        gate.step(1, kept=False, hinted=True)
    closed = 0
    while not gate.open:
        gate.step(1, kept=False, hinted=False)
        closed += 1
    assert closed == 10  # the kept hint reset the pause to its first length


def test_an_untimed_round_teaches_acceptance_but_not_costs() -> None:
    """A round whose wait was a switch's (``timed=False``) leaves the costs as they were
    (one such round of 2 s, taken, would make every draft length look dear), while its
    acceptance and drafting time count."""
    policy = DraftLengthPolicy(k_max=8)
    for _ in range(6):
        policy.observe(4, 4, 0.004, 0.010, 0.002)
    costs = [policy.cost(k) for k in range(1, 9)]
    kept = policy.acceptance()
    policy.observe(4, 0, 0.004, 2.0, 1.5, timed=False)
    assert [policy.cost(k) for k in range(1, 9)] == costs
    assert policy.acceptance()[0] < kept[0]
    policy.observe(4, 0, 0.004, 2.0, 1.5)  # the planted bug: taken as a sample
    assert policy.cost(4) > 10 * costs[3]
