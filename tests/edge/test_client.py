"""The edge's one generation loop (:class:`~spececd.edge.client.EdgeClient`) and its
strategies, against a verifier in this process (the in-memory transport), on the
torch-free toy pair: plain rounds, block-ahead rounds, stream drafting, auto, and
cloud-only generation. Greedy output must be the toy target's own greedy decode, and
sampled output a function of the seed alone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from spececd.backends.base import tokenizer_fingerprint
from spececd.core.chooser import Arm, HintGate
from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import DraftLengthPolicy, Ema
from spececd.core.stats import GenerationStats
from spececd.edge.client import EdgeClient
from spececd.edge.drafter import Drafter
from spececd.edge.link import Link
from spececd.edge.options import EdgeOptions, Reconnect, Site, resolve
from spececd.edge.transport import Transport
from spececd.protocol import messages as m
from spececd.protocol.edge_session import EdgeSession
from spececd.transports.memory import LocalServer, local_verifier
from tests.toy import ToyBackend, greedy, toy_pair

PROMPTS = [list(b"def f(x):"), list(b"import os"), list(b"x = [")]
N = 40  # tokens generated per prompt


@pytest.fixture()
def verifier(toy: tuple[ToyBackend, ToyBackend]) -> Iterator[LocalServer]:
    server = local_verifier(toy[1])
    yield server
    server.close()


@dataclass
class Edge:
    """An edge client and the options its generations are resolved from."""

    client: EdgeClient
    options: EdgeOptions
    site: Site  # as against a server (the verifier is one in all but its address): auto chooses

    def close(self) -> None:
        self.client.close()


def client(draft: ToyBackend, verifier: LocalServer, **options: object) -> Edge:
    fingerprint = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
    return Edge(EdgeClient(Drafter(draft), verifier, fingerprint, draft.max_context),
                EdgeOptions().with_settings(**options),
                Site(in_process=False, vocab_size=draft.vocab_size))


def generate(edge: Edge, prompt: list[int], stats: GenerationStats | None = None,
             cloud_only: bool = False, **params: object) -> list[int]:
    settings: dict[str, object] = {"temperature": 0.0, "seed": 1, "max_tokens": N, **params}
    run = resolve(edge.options, settings, edge.site, len(prompt))
    rounds = edge.client.generate(prompt, run, stats or GenerationStats(), cloud_only)
    return [t for out in rounds for t in out.token_ids]


@pytest.mark.parametrize("proactive,k", [("off", 4), ("off", "auto"), ("on", 4), ("on", "auto"),
                                         ("stream", 4), ("auto", 4)])
@pytest.mark.parametrize("mode", ["exact", "match", "greedy"])
def test_greedy_output_is_the_targets_own(toy: tuple[ToyBackend, ToyBackend],
                                          verifier: LocalServer, proactive: str, k: object,
                                          mode: str) -> None:
    draft, target = toy
    edge = client(draft, verifier, mode=mode, k=k, proactive=proactive)
    for prompt in PROMPTS:
        stats = GenerationStats()
        assert generate(edge, prompt, stats) == greedy(target, prompt, N)
        assert stats.generated == N
        # Hints race an instant target (see the test below): where auto streamed the
        # whole generation, like stream, it may have used none.
        if stats.auto_stream_tokens < stats.generated and proactive != "stream":
            # The draft agrees at 70% of contexts: a loop that never used its drafts (or
            # a verifier that rejected them all) would still be right, but accept nothing.
            assert stats.accepted > 0
    edge.close()


@pytest.mark.parametrize("proactive", ["off", "on", "stream"])
def test_token_trees_keep_the_output_the_targets_own(toy: tuple[ToyBackend, ToyBackend],
                                                     verifier: LocalServer,
                                                     proactive: str) -> None:
    """Drafts branched into trees (the toy target has tree attention): siblings are sent
    where the draft is unsure, and the output is still the target's own."""
    draft, target = toy
    edge = client(draft, verifier, mode="greedy", k=4, proactive=proactive, tree_width=3)
    siblings = 0
    for prompt in PROMPTS:
        stats = GenerationStats()
        assert generate(edge, prompt, stats) == greedy(target, prompt, N)
        siblings += stats.tree_siblings
    if proactive != "stream":  # (a hint's tree depends on how its steps were timed)
        # Trees were drafted and sent, not only chains: over 90 siblings in every run
        # here, their number depending on the measured costs that shape the trees.
        assert siblings > 0
    edge.close()


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    draft, target = toy_pair(agreement=1.0)
    server = local_verifier(target)
    try:
        edge = client(draft, server, k=4, proactive="off")
        stats = GenerationStats()
        assert generate(edge, PROMPTS[0], stats, max_tokens=21) == greedy(target, PROMPTS[0], 21)
        # Four rounds of 4 accepted + 1 bonus, then a round drafting nothing for the last
        # token (a first position counted as always accepted, or a bonus counted as a
        # draft, changes these counts).
        assert (stats.rounds, stats.drafted, stats.accepted) == (5, 16, 16)
        assert stats.target_passes == 5
    finally:
        server.close()


@pytest.mark.parametrize("end", [0, 2, 4])
def test_statistics_count_no_token_past_the_end_of_the_text(end: int) -> None:
    """A stop token at position ``end`` of a round's 4 accepted drafts (4: the bonus, the
    verifier's own token): the drafts after it are no part of the text, so they count as
    neither drafted nor accepted, and the round gains the tokens it emitted (the issue's
    "acceptance 25.0% · mean accepted length 2.00 · 1 tokens" counted them)."""
    draft, target = toy_pair(agreement=1.0)
    reference = greedy(target, PROMPTS[2], 5)
    stop = reference[end]
    if reference.index(stop) != end:
        pytest.skip("the toy's text repeats this token earlier")
    server = local_verifier(target)
    try:
        edge = client(draft, server, k=4, proactive="off")
        stats = GenerationStats()
        assert generate(edge, PROMPTS[2], stats, stop_token_ids=[stop]) == reference[:end + 1]
        drafted = min(end + 1, 4)
        assert (stats.rounds, stats.drafted, stats.accepted) == (1, drafted, drafted)
        assert stats.acceptance_rate == 1.0
        assert stats.mean_accepted_len == stats.generated == end + 1
        assert stats.drafted_by_position == stats.accepted_by_position == [1] * drafted
    finally:
        server.close()


def test_block_ahead_rounds_hit_when_the_draft_is_the_target() -> None:
    """Drafting the next block while the verdict is in flight: with every token accepted
    and the bonus guessed right, every round after the first sends the block drafted
    ahead (a block drafted ahead for the wrong history, or never used, fails this)."""
    draft, target = toy_pair(agreement=1.0)
    server = local_verifier(target)
    try:
        edge = client(draft, server, k=4, proactive="on")
        stats = GenerationStats()
        assert generate(edge, PROMPTS[1], stats, max_tokens=25) == greedy(target, PROMPTS[1], 25)
        assert stats.rounds == 5 and stats.proactive_rounds == 5
        assert stats.proactive_hits == 4  # the first round had nothing drafted ahead
    finally:
        server.close()


def test_stream_drafting_hints_are_verified_by_the_server() -> None:
    """Stream drafting with the target itself as the draft: every hinted token the server
    verified was kept (hints placed at the wrong position would be rejected), and the
    server took tokens from them (a server that ignored hints would take none). The
    target sleeps 5 ms a pass, as a real one takes, so that hints arrive before its steps
    (with an instant target they race it: 8 to 28 of 40 tokens came from hints here)."""
    draft, target = toy_pair(agreement=1.0)
    target.pass_s = 0.005
    server = local_verifier(target)
    try:
        edge = client(draft, server, k=4, proactive="stream")
        stats = GenerationStats()
        assert generate(edge, PROMPTS[2], stats) == greedy(target, PROMPTS[2], N)
        assert stats.accepted > 0 and stats.accepted == stats.drafted
        assert stats.target_passes < N  # hinted tokens came several to a step
    finally:
        server.close()


@pytest.mark.parametrize("proactive", ["stream", "off"])
def test_sampled_speculation_by_match_is_the_targets_own_sample(
        toy: tuple[ToyBackend, ToyBackend], verifier: LocalServer, proactive: str) -> None:
    """Match verification draws each position's token from the target with randomness
    that depends on (seed, position) only: speculating must give exactly the tokens the
    server generates alone for that seed (a verifier that kept a draft the target did not
    sample, or drew from a stream shifted by the round boundaries, fails this)."""
    draft, _ = toy
    edge = client(draft, verifier, mode="match", k=4, proactive=proactive)
    for seed in (3, 4):
        alone = generate(edge, PROMPTS[0], cloud_only=True, temperature=1.0, seed=seed)
        assert generate(edge, PROMPTS[0], temperature=1.0, seed=seed) == alone
    assert generate(edge, PROMPTS[0], temperature=1.0, seed=3) != \
        generate(edge, PROMPTS[0], temperature=1.0, seed=4)  # the seed has an effect
    edge.close()


def test_exact_sampling_repeats_for_a_seed(toy: tuple[ToyBackend, ToyBackend],
                                           verifier: LocalServer) -> None:
    draft, _ = toy
    edge = client(draft, verifier, mode="exact", k=4, proactive="off")
    runs = [generate(edge, PROMPTS[1], temperature=0.9, top_k=20, seed=seed)
            for seed in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    edge.close()


@pytest.mark.parametrize("proactive", ["off", "on", "stream"])
def test_max_tokens_and_stop_tokens_end_the_generation_exactly(
        toy: tuple[ToyBackend, ToyBackend], verifier: LocalServer, proactive: str) -> None:
    draft, target = toy
    edge = client(draft, verifier, k=4, proactive=proactive)
    reference = greedy(target, PROMPTS[0], N)
    for max_tokens in (1, 2, 5, 9):
        assert generate(edge, PROMPTS[0], max_tokens=max_tokens) == reference[:max_tokens]
    for position in (0, 3, 10):
        stop = reference[position]
        first = reference.index(stop)
        out = generate(edge, PROMPTS[0], stop_token_ids=(stop,))
        assert out == reference[:first + 1]
    edge.close()


def test_auto_streams_from_the_start_where_rounds_cannot_win() -> None:
    """Stream drafting measures, on its client, the server's step, the draft's and the
    share of hinted tokens kept; with the hellos' round trip they bound what rounds could
    bring. Where the round trip alone outlasts what the server takes to generate the most
    a round could bring, auto streams from its first generation and never measures rounds
    (a chooser that knew nothing would begin with a segment of rounds); over this link, in
    the same process, where rounds could win, it measures rounds first, as ever."""
    draft, target = toy_pair(agreement=0.7)
    target.pass_s = 0.005  # a target about as slow as a real one
    server = local_verifier(target)
    try:
        for rtt in (1.0, None):
            edge = client(draft, server, k=4, proactive="stream")
            generate(edge, PROMPTS[0])
            estimate = edge.client.rounds_estimate
            assert 100 < estimate.cloud_only() < 200  # a step of 5 ms and a little more
            assert 0 < estimate.acceptance() < 1  # hints were verified, some kept
            if rtt is not None:  # as the hellos of a slow link would have measured it
                edge.client.link.rtt = Ema(rtt, seen=True)
            edge.options = edge.options.with_settings(proactive="auto")
            stats = GenerationStats()
            assert generate(edge, PROMPTS[1], stats) == greedy(target, PROMPTS[1], N)
            rounds = edge.client.chooser.speed(Arm.ROUNDS)
            if rtt is not None:
                assert stats.auto_stream_tokens == N and rounds is None
            else:
                assert stats.auto_stream_tokens < N and rounds is not None
            edge.close()
    finally:
        server.close()


def test_auto_reads_where_hints_cost_the_server_more_than_they_bring() -> None:
    """A target whose steps cost 1 ms and each position a verify pass adds 4 ms more, a
    draft that agrees half the time: the server keeps enough hints for the hint gate to
    stay open, but each costs it more than it brings, and rounds pay the same per
    position. Auto (after measuring rounds and hints) lets the server generate alone,
    within the generation it finds that in, at cloud-only's rate; the output stays the
    target's own. Before the server alone was one of auto's choices, it streamed hints
    to the end, at about a third of that."""
    draft, target = toy_pair(agreement=0.5)
    target.pass_s, target.position_s = 0.001, 0.004
    server = local_verifier(target)
    edge = client(draft, server, proactive="auto")
    try:
        late = GenerationStats()
        for g in range(10):
            prompt = PROMPTS[g % len(PROMPTS)]
            stats = GenerationStats()
            assert generate(edge, prompt, stats, max_tokens=64) == greedy(target, prompt, 64)
            if g >= 5:
                late.merge(stats)
        assert edge.client.chooser.leader() is Arm.STREAM
        assert edge.client.hints_chooser.leader() is Arm.CLOUD
        # Auto still probes rounds now and then (one probe took 41 of 3 generations' 192
        # tokens): over the last five generations the server alone wrote most of them,
        # where streaming hints to the end gave it none.
        assert late.auto_cloud_tokens > 0.7 * late.generated
    finally:
        edge.close()
        server.close()


def test_auto_measures_no_hints_where_none_were_out() -> None:
    """Auto streams with the hint gate closed (hints kept arriving too late, say): no
    hint goes out, the server generates alone (and the statistics count its tokens so),
    and the hints arm, under way, is not measured by it (its exchanges counted as hints'
    gave hints cloud-only's speed). The output is the target's own."""
    draft, target = toy_pair(agreement=1.0)
    target.pass_s = 0.002
    server = local_verifier(target)
    edge = client(draft, server, k=4, proactive="auto")
    # A fruitless hinted step closes it, for longer than this test runs.
    edge.client.hint_gate = gate = HintGate(patience=1, first_pause=10**9)
    gate.step(1, kept=False, hinted=True)
    try:
        stats = GenerationStats()
        for prompt in PROMPTS:
            assert generate(edge, prompt, stats, max_tokens=64) == greedy(target, prompt, 64)
        # (streamed: a probe of two segments, then rounds again, faster)
        assert not gate.open and stats.auto_stream_tokens >= 2 * 16
        assert edge.client.hints_chooser.speed(Arm.STREAM) is None
        assert stats.auto_cloud_tokens == stats.auto_stream_tokens  # all the server alone's
    finally:
        edge.close()
        server.close()


def test_a_lookup_that_finds_nothing_sends_no_hint(toy: tuple[ToyBackend, ToyBackend],
                                                   verifier: LocalServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Stream drafting by lookup on text that never repeats within the lookahead: where
    nothing is found the edge waits for the server's next tokens (an empty hint, sent
    again and again, spun a core and ~1 KB a token), and the output is the target's."""
    from spececd.protocol.edge_session import EdgeSession

    draft, target = toy
    hinted: list[int] = []
    hint = EdgeSession.hint

    def counted(self: EdgeSession, *args: object) -> bytes:
        hinted.append(len(args[1]))  # type: ignore[arg-type]
        return hint(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(EdgeSession, "hint", counted)
    edge = client(draft, verifier, k=4, proactive="stream", draft_source="lookup")
    for prompt in PROMPTS:
        assert generate(edge, prompt) == greedy(target, prompt, N)
    assert 0 not in hinted
    edge.close()


def test_auto_leaves_a_stream_midway_where_rounds_are_faster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto has measured rounds, fast, and probes streaming (the server alone here: the
    hint gate is closed, so streaming brings a token per step where rounds bring five).
    When the probe's two segments end, the generation goes back to rounds within itself,
    not at its end: the edge leaves the stream (the tokens received are kept; the hello
    that greets the rounds' session ends the stream, and its frames still in flight are
    skipped). The output is the target's own."""
    draft, target = toy_pair(agreement=1.0)
    target.pass_s = 0.002
    server = local_verifier(target)
    edge = client(draft, server, k=4, proactive="auto")
    edge.client.chooser.record(Arm.ROUNDS, 16, 0.001)  # rounds measured, fast
    edge.client.hint_gate = gate = HintGate(patience=1, first_pause=10**9)
    gate.step(1, kept=False, hinted=True)  # closed: streaming is the server alone
    left: list[int | None] = []
    after = Link._after

    def spy(transport: Transport, stale: int | None) -> bytes:
        left.append(stale)
        return after(transport, stale)

    monkeypatch.setattr(Link, "_after", staticmethod(spy))
    timed: list[bool] = []  # each round's, as adaptive k took it
    observe = DraftLengthPolicy.observe

    def observed(policy: DraftLengthPolicy, *args: Any, **kw: Any) -> None:
        timed.append(kw.get("timed", True))
        observe(policy, *args, **kw)

    monkeypatch.setattr(DraftLengthPolicy, "observe", observed)
    try:
        stats = GenerationStats()
        n = 128
        assert generate(edge, PROMPTS[0], stats, max_tokens=n) == greedy(target, PROMPTS[0], n)
        # The round after the switch back (its wait: a new hello, the server catching up)
        # is no sample of a round's cost for adaptive k; every other round is.
        assert timed.count(False) == 1 and not timed[0], timed  # it began with the probe
        # Streamed: the probe's two segments of 16 (after an unmeasured first exchange).
        assert 2 * 16 <= stats.auto_stream_tokens < n // 2
        assert stats.accepted >= n // 4  # the rest in rounds, their drafts all kept
        assert any(stale is not None for stale in left)  # the hello after the stream
        assert edge.client.chooser.leader() is Arm.ROUNDS
    finally:
        edge.close()
        server.close()


@pytest.mark.parametrize("step_fails", [False, True])
def test_a_stream_left_under_way_has_its_frames_skipped(step_fails: bool) -> None:
    """The link leaves a generation under way while the server is still sending it; the
    next session greets on the same connection, and its first round's verdict is read
    past every ``Tokens`` frame of the stream (which a session would refuse as
    unexpected), and past the error of a step of the stream that failed (here: past the
    context the toy target then holds), which is the stream's (its sequence number), not
    the next session's."""
    draft, target = toy_pair(agreement=1.0)
    target.pass_s = 0.001
    server = local_verifier(target)
    fingerprint = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
    params = SamplingParams(temperature=0.0, seed=1)
    link = Link(server, Reconnect())
    stats = GenerationStats()
    try:
        streaming = EdgeSession(fingerprint, Mode.MATCH, params)
        prompt = PROMPTS[0]
        first = link.exchange(streaming, lambda _: streaming.generate(prompt, 200, ()), stats)
        assert isinstance(first, m.Tokens) and streaming.generating is not None
        had = len(first.token_ids)
        if step_fails:
            target.max_context = len(prompt) + had + 10  # the stream's steps past it fail
        time.sleep(0.1)  # the server generates on: its frames queue on the connection
        history = [*prompt, *first.token_ids]
        link.leave_stream()
        rounds = EdgeSession(fingerprint, Mode.MATCH, params)
        reference = greedy(target, prompt, had + 3)
        guess = tuple(reference[had:had + 2])
        verdict = link.exchange(rounds, lambda _: rounds.draft(history, guess, None), stats)
        assert isinstance(verdict, m.Verdict) and verdict.num_accepted == 2
        assert verdict.next_token == reference[had + 2]
        assert link.rtt.seen is False  # a hello answered after a step is no round trip
    finally:
        link.close()
        server.close()
