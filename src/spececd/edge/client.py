"""The edge's generation loop: one loop, whatever the strategy.

:meth:`EdgeClient.generate` greets the verifier, picks the strategy the options ask for
(:mod:`spececd.edge.strategies`: plain rounds, block-ahead, stream drafting, or
cloud-only generation) and runs it one exchange at a time; every token goes through one
:class:`~spececd.edge.emit.Emitter`, which applies stop tokens, ``max_tokens`` and the
context limit exactly and counts what was emitted. The link to the verifier
(:mod:`spececd.edge.link`) stays open across generations and reconnects on its own; when
the verifier stays unreachable the loop raises :class:`CloudUnreachable` or, with
``fallback="draft"``, finishes with the draft model alone and says so.

The loop does not know whether the verifier is in this process or across the world.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence

from spececd.core.chooser import Arm, HintGate, StrategyChooser
from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import RoundsEstimate
from spececd.core.stats import GenerationStats
from spececd.edge.drafter import DraftSource
from spececd.edge.emit import Emitter, RoundOutput
from spececd.edge.link import CloudUnreachable, Link
from spececd.edge.lookup import PredictionLookup
from spececd.edge.options import DraftKind, Fallback, Proactive, Reconnect, Resolved
from spececd.edge.sources import DraftSources, PredictedDraft
from spececd.edge.strategies import (
    Adaptive,
    BlockAhead,
    CloudOnly,
    DraftAlone,
    Rounds,
    Strategy,
    StreamDrafting,
    Work,
)
from spececd.edge.transport import Transport
from spececd.protocol.edge_session import EdgeSession
from spececd.protocol.messages import Fingerprint

__all__ = ["CloudUnreachable", "EdgeClient", "Reconnect", "RoundOutput"]

log = logging.getLogger(__name__)

# With --fallback draft: seconds between tries of the verifier while the draft goes on alone
# (it takes the generation back once it answers).
PROBE_EVERY = 1.0


class EdgeClient:
    """Generates against the verifier ``connect`` reaches, drafting with ``drafter`` (the
    draft model's source; None: no draft model here) or a model-free source, as each
    generation's options say (:class:`~spececd.edge.sources.DraftSources`). Each
    generation's resolved options (:class:`~spececd.edge.options.Resolved`) choose the
    strategy; with ``Proactive.AUTO`` the client measures which of block-ahead rounds and
    stream drafting is faster on its link (:class:`Adaptive`), learning across its
    generations."""

    def __init__(self, drafter: DraftSource | None, connect: Callable[[], Transport],
                 fingerprint: Fingerprint, max_context: int, auth_token: str = "") -> None:
        self.sources = DraftSources(drafter)
        self.fingerprint = fingerprint
        self.max_context = max_context
        self.auth_token = auth_token
        self.link = Link(connect, Reconnect())  # each generation sets its own (_strategy)
        # What this client has learnt of its link: which way to speculate (auto), whether
        # stream drafting's hints arrive in time, and what rounds would bring (measured
        # while streaming), with the server's draft limit as last welcomed.
        self.chooser, self.hint_gate = StrategyChooser(), HintGate()
        self.rounds_estimate, self.max_draft, self.width = RoundsEstimate(), 0, 0
        # Within rounds: block-ahead or plain; within streaming: hints, or none (the server
        # alone, cloud-only generation), switched at any step (the server's generation
        # goes on either way).
        self.rounds_chooser = StrategyChooser(arms=(Arm.AHEAD, Arm.PLAIN), probe_within=True)
        self.hints_chooser = StrategyChooser(arms=(Arm.STREAM, Arm.CLOUD), probe_within=True)

    def close(self) -> None:
        """Close the link to the server (the generator is done with it)."""
        self.link.close()

    def generate(self, prompt_ids: Sequence[int], run: Resolved, stats: GenerationStats,
                 cloud_only: bool = False) -> Generator[RoundOutput, None, None]:
        """Generate after ``prompt_ids`` with what ``run`` resolved (its seed set), yielding
        what each exchange emits. ``cloud_only``: the verifier generates every token (a
        baseline). A prediction of the output (``run.prediction``, Predicted Outputs) is
        drafted from where the output follows it, before the options' own source
        (:class:`~spececd.edge.sources.PredictedDraft`)."""
        params = run.params
        # Cloud-only generation drafts nothing: any source will do, and lookup needs no model.
        drafter = self.sources.get(DraftKind.LOOKUP if cloud_only else run.options.draft_source,
                                   run.options.lookup_memory)
        predicted = None
        if run.prediction and not cloud_only:
            drafter = predicted = PredictedDraft(PredictionLookup(run.prediction), drafter)
        out = Emitter(prompt_ids, params, stats, self.max_context,
                      drafter.forced_among if params.constraint is not None else None,
                      drafter.looked_up_among,
                      predicted.predicted_among if predicted is not None else None)
        start = time.perf_counter()
        probe = False  # the verifier was unreachable: try it once, without waiting
        strategy: Strategy | None = None
        finished = False
        try:
            while True:
                try:
                    strategy = self._strategy(drafter, out, run, stats, cloud_only, probe)
                    yield from self._run(strategy, out)
                    finished = True
                    return
                except CloudUnreachable:
                    if run.options.fallback is not Fallback.DRAFT:
                        raise
                if not probe:
                    log.warning("the verifier is unreachable: generating with the draft model "
                                "alone (unverified, marked as such) until it answers again")
                out.fall_back(self.max_context)
                if (yield from self._draft_alone(drafter, out, params, stats)):
                    finished = True
                    return
                probe = True
        finally:
            stats.wall_s += time.perf_counter() - start
            if not finished and strategy is not None and strategy.streams:
                # Left early (a stop string, a caller gone) while the server generates:
                # its next frames belong to no generation, so this connection ends here.
                self.link.drop()

    def _draft_alone(self, drafter: DraftSource, out: Emitter, params: SamplingParams,
                     stats: GenerationStats) -> Generator[RoundOutput, None, bool]:
        """The draft alone for :data:`PROBE_EVERY` seconds (the verifier is unreachable);
        True when that finished the generation. The draft model where there is one, else
        ``drafter`` (a lookup, which may find nothing to go on with)."""
        alone = DraftAlone(self.sources.model or drafter, params, stats)
        until = time.monotonic() + PROBE_EVERY
        while time.monotonic() < until:
            for piece in alone.step(out):
                emitted = out.emit(piece)
                yield emitted
                if emitted.finished:
                    return True
        return False

    @staticmethod
    def _run(strategy: Strategy, out: Emitter) -> Iterator[RoundOutput]:
        while True:
            for piece in strategy.step(out):
                emitted = out.emit(piece)
                yield emitted
                if emitted.finished:
                    return

    def _strategy(self, drafter: DraftSource, out: Emitter, run: Resolved,
                  stats: GenerationStats, cloud_only: bool, probe: bool = False) -> Strategy:
        """Greet the verifier and set up the strategy ``run``'s options choose. ``probe``:
        the verifier was unreachable, and the draft generates alone: try it once, and
        continue verified if it answers."""
        options, params = run.options, run.params
        self.link.reconnect = options.link_reconnect(probe)
        streams = cloud_only or options.proactive is Proactive.STREAM
        mode, _ = options.session_mode(streams)
        trees = options.tree_width > 1 and not cloud_only  # in rounds, and in hints
        session = edge_session(run, self.fingerprint, self.auth_token, streams, trees)
        # Auto: rounds in the asked mode, or streaming by match (the same session when the
        # mode is match), whichever the chooser starts this generation with.
        auto = options.proactive is Proactive.AUTO and not cloud_only
        if auto:
            self.bound_rounds(run)
        arm = self.chooser.start() if auto else None
        stream_session = session if mode is Mode.MATCH else edge_session(
            run, self.fingerprint, self.auth_token, True, trees)
        welcome = self.link.greet(stream_session if arm is Arm.STREAM else session, stats)
        self.link.reconnect = options.link_reconnect()
        self.max_draft, self.width = welcome.max_draft, welcome.pass_width
        if auto:
            self.bound_rounds(run)  # with the round trip the hello just measured
        if probe:
            log.warning("the verifier answers again: generation is verified from here on")
            out.verified_again()
        stats.lossy = stats.lossy or welcome.lossy
        out.max_context = min(out.max_context, welcome.max_context)
        # The drafter drafts under the constraint unless told not to; the session's
        # hello carries it either way (the verifier masks).
        drafting = params if options.constrained_drafting else dataclasses.replace(
            params, constraint=None)
        work = Work(drafter, self.link, session, mode, drafting, stats,
                    options.max_support, options.tree_width)
        k_max = options.draft_limit(welcome.max_draft)
        width = welcome.pass_width if options.k is None else 0  # free drafts' (k auto)
        if cloud_only:
            return CloudOnly(work)
        if arm is not None:
            stream = dataclasses.replace(work, session=stream_session, mode=Mode.MATCH)
            return Adaptive(work, stream, self.chooser, self.rounds_chooser,
                            self.hints_chooser, self.hint_gate, self.rounds_estimate, arm,
                            k_max, adaptive=options.k is None, width=width)
        if options.proactive is Proactive.STREAM:
            return StreamDrafting(work, ahead=k_max, gate=self.hint_gate,
                                  estimate=self.rounds_estimate, width=width)
        rounds = BlockAhead if options.proactive is Proactive.ON else Rounds
        return rounds(work, k_max, adaptive=options.k is None, width=width)

    def bound_rounds(self, run: Resolved) -> None:
        """Tell the chooser what rounds could bring here, by what this client has measured
        (the hellos' round trip; from stream drafting, the server's step, the draft's and
        the share of hinted tokens kept), and that streaming brings at least the server's
        own generation: rounds that cannot win are not run (the chooser's :meth:`~spececd.
        core.chooser.StrategyChooser.cap`). With ``k`` auto, rounds may send drafts that
        cost nothing as far as the server's pass width: the bound counts them so."""
        if not self.max_draft:
            return  # never welcomed: nothing measured
        options = run.options
        # Exact verification of sampled drafts keeps at least as many as match, by which
        # hints are verified: there, the ceiling (every draft kept).
        ceiling = options.session_mode(False)[0] is Mode.EXACT and run.params.temperature > 0
        estimate = self.rounds_estimate
        longest = options.draft_limit(self.max_draft)
        if options.k is None:
            longest = max(longest, self.width)
        self.chooser.cap(Arm.ROUNDS, estimate.speed(longest, self.link.rtt.value, ceiling))
        self.chooser.floor(Arm.STREAM, estimate.cloud_only())


def edge_session(run: Resolved, fingerprint: Fingerprint, auth_token: str, streams: bool,
                 trees: bool) -> EdgeSession:
    """The session a generation greets the verifier with: ``run``'s sampling parameters, in
    the mode its options verify in (by match where the server generates: ``streams``);
    ``trees``: offering token trees."""
    mode, threshold = run.options.session_mode(streams)
    return EdgeSession(fingerprint, mode, run.params, auth_token, threshold, trees=trees)
