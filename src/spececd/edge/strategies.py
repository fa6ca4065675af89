"""How the edge works with the verifier: the strategies of the one generation loop.

Each strategy's ``step`` runs one exchange and returns the :class:`~spececd.edge.emit.Piece`
objects it brought back, in order; the loop (:meth:`spececd.edge.client.EdgeClient.generate`)
hands them to the :class:`~spececd.edge.emit.Emitter`, which clips, counts and says when
to stop. A strategy reads the history and the token budget from the emitter, keeps its
own statistics (drafting, rounds, timings) and never emits.

- :class:`Rounds`: draft ``k`` tokens, send them, wait for the verdict;
- :class:`BlockAhead`: the same, drafting the next block while the verdict is in flight;
- :class:`CloudOnly`: the server generates every token and streams it (the baseline);
- :class:`StreamDrafting`: cloud-only generation with drafts streamed ahead as hints;
- :class:`Adaptive`: plain or block-ahead rounds, stream drafting or the server alone,
  whichever is faster here (:class:`~spececd.core.policy.StrategyChooser`);
- :class:`DraftAlone`: the fallback when the verifier is unreachable, unverified.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import (
    Arm,
    DraftLengthPolicy,
    Ema,
    HintGate,
    LinearFit,
    RoundsEstimate,
    StrategyChooser,
    TreeShape,
    hint_shape,
    stream_lookahead,
)
from spececd.core.sampling import SparseProbs
from spececd.core.stats import GenerationStats
from spececd.edge.drafter import DraftSource, Tree
from spececd.edge.emit import Emitter, Piece
from spececd.edge.link import Link, Reply
from spececd.errors import SpecECDError
from spececd.protocol import messages as m
from spececd.protocol.edge_session import EdgeSession

STREAM_CHUNK_OF_STEP = 0.5  # stream drafting: a hint every half server step of drafting

Block: TypeAlias = tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]  # tokens, dists


class Strategy(Protocol):
    @property
    def streams(self) -> bool:
        """Whether the server generates on its own (a generation left may still send)."""
        ...

    def step(self, out: Emitter) -> list[Piece]:
        """One exchange with the server as the strategy does it; what it emitted, as pieces
        for the emitter (none when the server had nothing yet)."""


@dataclass(frozen=True)
class Work:
    """What every strategy works with during one generation."""

    drafter: DraftSource
    link: Link
    session: EdgeSession
    mode: Mode  # the session's verification mode
    params: SamplingParams  # seed set
    stats: GenerationStats
    max_support: int
    tree_width: int = 1  # candidates per position in a round's draft (if the server takes trees)

    def draft(self, history: Sequence[int], k: int) -> Block:
        """A chain of up to ``k`` tokens drafted after ``history`` with the session's
        settings (the tokens and, in exact mode, their distributions); tokens proposed
        without a model step are not counted as draft steps."""
        assert self.params.seed is not None
        before = self.free_counts()
        block = self.drafter.draft(history, k, self.mode, self.params, self.params.seed,
                                   self.max_support)
        self.count_free(before)
        return block

    def free_counts(self) -> tuple[int, int]:
        """What the drafter has proposed without a model step so far: tokens a constraint
        forced, and tokens looked up."""
        return self.drafter.forced, self.drafter.looked_up

    def count_free(self, before: tuple[int, int]) -> None:
        """Uncount the tokens proposed without a model step since :meth:`free_counts` was
        ``before``: callers count every drafted token as a draft step, and these were none
        (the emitter counts those the output kept). Count the looked-up ones as such."""
        forced, looked_up = self.free_counts()
        self.stats.draft_steps -= forced - before[0] + looked_up - before[1]
        self.stats.lookup_drafted += looked_up - before[1]

    def free(self, history: Sequence[int], k: int, room: int = 0,
             policy: DraftLengthPolicy | None = None) -> Tree | None:
        """The drafter's draft after ``history`` where it proposes one without a model step
        (:meth:`~spececd.edge.drafter.DraftSource.free`): up to ``k`` deep, branched as
        ``policy`` finds worth it where the server verifies trees (None: a chain); None
        where it would draft with the model."""
        shape = self.shape(k, room, policy) if policy is not None else None
        before = self.free_counts()
        tree = self.drafter.free(history, k, shape, self.mode, self.params)
        self.count_free(before)
        return tree

    def shape(self, k: int, room: int, policy: DraftLengthPolicy) -> TreeShape | None:
        """How a round's draft of ``k`` may branch (None: a chain), in at most ``room``
        nodes."""
        welcome = self.session.welcome
        width = self.tree_width if self.session.trees else 1
        if width == 1 or welcome is None:
            return None
        return policy.tree_shape(k, width, max(k, min(k * width, welcome.max_draft, room)))

    def tree(self, history: Sequence[int], k: int, room: int, policy: DraftLengthPolicy
             ) -> Tree:
        """A round's draft: a chain of ``k`` tokens, branched as ``policy`` finds worth it
        when the server verifies trees, in at most ``room`` nodes."""
        shape = self.shape(k, room, policy)
        if shape is None:
            return Tree.of_chain(*self.draft(history, k))
        assert self.params.seed is not None
        before = self.free_counts()
        tree = self.drafter.tree(history, k, shape, self.mode, self.params, self.params.seed,
                                 self.max_support)
        self.count_free(before)
        return tree


class Rounds:
    """Plain rounds: draft ``k`` tokens after the history, send them, and take the
    verdict's accepted drafts plus the verifier's own token. ``k`` is fixed (``k_max``) or,
    ``adaptive``, chosen each round by :class:`DraftLengthPolicy` from live measurements.

    Sampled in exact mode with a fixed ``k`` in chains, a seed fixes the tokens only if
    every block ends where an uninterrupted run's does (an exact-mode draw depends on
    whether a drafted token stands at its position): such rounds draft whole blocks
    whatever the server's budget, and where the server cut a chain and kept its first token
    past the cut (the verifier decides that token as an uncut block would), the next round
    sends the rest of the block.

    Drafts that cost nothing to draft (a lookup's, a prediction's:
    :meth:`~spececd.edge.drafter.DraftSource.free`) have a length policy of their own when
    adaptive, up to ``width`` (the server's pass width): where their runs keep being
    accepted, a round sends them as far as the measured tokens per second pay, not the
    ``k_max`` that bounds drafts a model step each. Whether a round drafts for free is a
    function of the history, as every draft length is, so it stays lossless."""

    proactive = False  # whether drafting overlaps the round trip (BlockAhead)
    streams = False

    def __init__(self, work: Work, k_max: int, adaptive: bool, width: int = 0) -> None:
        self.work, self.k_max, self.adaptive = work, k_max, adaptive
        # Measures always (trees take their shape from it); chooses k when adaptive.
        self.policy = DraftLengthPolicy(k_max=k_max, proactive=self.proactive)
        # Free drafts' own (None: k fixed), starting where model drafts are bounded.
        self.free_policy = DraftLengthPolicy(k_max=max(k_max, width), k_initial=k_max,
                                      proactive=self.proactive) if adaptive else None
        self.free_round = False  # whether this round's draft cost nothing to draft
        self.fixed_blocks = (not adaptive and work.mode is Mode.EXACT
                             and not work.params.greedy and work.tree_width == 1)
        # A block the server cut: the history its rest continues, the chain sent, and where
        # its rest starts.
        self.rest: tuple[list[int], Tree, int] | None = None
        # The next round follows a switch from streaming (a new hello, the server catching
        # up): its wait is no sample of what a round costs.
        self.cold = False

    @property
    def round_policy(self) -> DraftLengthPolicy:
        """The length policy of this round's kind of draft: free drafts' or model drafts'."""
        free = self.free_policy
        return free if free is not None and self.free_round else self.policy

    def choose(self, limit: int, policy: DraftLengthPolicy | None = None) -> int:
        """The draft length for a round with ``limit`` positions left: ``policy``'s choice
        (default: model drafts') when adaptive, else ``k_max`` (at most ``limit``), and never
        past the server's budget (the positions it expects to verify: it would cut the
        rest), except in fixed blocks."""
        budget = self.work.session.budget
        if budget is not None and not self.fixed_blocks:
            limit = min(limit, budget)
        policy = policy or self.policy
        return policy.choose(limit) if self.adaptive else min(self.k_max, limit)

    def step(self, out: Emitter) -> list[Piece]:
        stats = self.work.stats
        limit = max(0, min(out.remaining, out.room) - 1)  # the verifier adds one token
        t0 = time.perf_counter()
        tree = self.draft(out.history, limit, out.room - 1)  # siblings add no depth
        draft_s = time.perf_counter() - t0
        round_start = time.perf_counter()
        verdict, hidden_s = self.send(out, tree)
        round_s = time.perf_counter() - round_start
        stats.draft_s += draft_s
        stats.tree_siblings += len(tree.tokens) - len(tree.chain)
        stats.record_pass(verdict.verify_s)
        # Where the server cut the draft (its budget), the positions past the cut were
        # never judged: neither rejections for adaptive k nor drafted in the stats.
        depth = len(tree.chain) if verdict.verified is None else min(len(tree.chain),
                                                                     verdict.verified)
        self.round_policy.observe(depth, verdict.num_accepted, draft_s, verdict.verify_s,
                                  round_s - verdict.verify_s - hidden_s, len(tree.tokens),
                                  timed=not self.cold)
        self.cold = False
        n = verdict.num_accepted
        path = tree.chain[:n] if verdict.path is None else verdict.path
        if self.fixed_blocks and verdict.path is None:
            chain = tree.trunk()  # what was sent
            if n < len(chain.tokens) and verdict.next_token == chain.tokens[n]:
                # Kept past a cut (a correction is never the drafted token itself).
                self.rest = ([*out.history, *chain.tokens[:n + 1]], chain, n + 1)
        return [Piece((*(tree.tokens[i] for i in path), verdict.next_token), from_draft=n,
                      logprobs=verdict.logprobs, prompt_logprobs=verdict.prompt_logprobs,
                      drafted=depth)]

    def draft(self, history: list[int], limit: int, room: int) -> Tree:
        """The round's draft after ``history``: up to ``limit`` tokens deep, its siblings
        within ``room``; the rest of a block the server cut, where it continues."""
        rest, self.rest = self.rest, None
        self.free_round = False
        if rest is not None and rest[0] == history:  # drafted already: a function of both
            _, chain, start = rest
            end = start + limit
            return Tree.of_chain(chain.tokens[start:end],
                                 None if chain.dists is None else chain.dists[start:end])
        tree = None
        if self.free_policy is not None:
            free = self.free_policy
            tree = self.work.free(history, self.choose(limit, free), room, free)
            self.free_round = tree is not None
        if tree is None:
            tree = self.work.tree(history, self.choose(limit), room, self.policy)
        self.work.stats.draft_steps += len(tree.chain)
        return tree

    def send(self, out: Emitter, tree: Tree) -> tuple[m.Verdict, float]:
        """The verdict on ``tree``, and the seconds spent drafting while it was awaited."""
        return self.verdict(out.history, tree), 0.0

    def verdict(self, history: list[int], tree: Tree,
                while_waiting: Callable[[], None] | None = None) -> m.Verdict:
        """Send ``tree`` after ``history`` (its chain alone where the server takes no trees)
        and wait for its verdict, running ``while_waiting`` meanwhile."""
        session = self.work.session

        def frame(greeted_now: bool) -> bytes:  # built late: a reconnect re-sends the history
            if tree.branched and session.trees:
                return session.draft(history, tree.tokens, tree.dists, tree.parents)
            # A chain, or a server (after a reconnect, maybe another) that takes none.
            trunk = tree.trunk()
            return session.draft(history, trunk.tokens, trunk.dists)

        verdict = self.work.link.exchange(session, frame, self.work.stats, while_waiting)
        assert isinstance(verdict, m.Verdict)
        return verdict


class Ahead:
    """A block drafted ahead, while a verdict is in flight: the bonus-token guess followed
    by the next round's draft, valid if the verdict accepts everything and its own token
    equals the guess."""

    def __init__(self, work: Work, context: list[int], k: int, free: bool = False) -> None:
        self.work, self.context, self.k = work, context, k
        self.free = free  # drafted only where it costs nothing (a free round's block ahead)
        self.tokens: tuple[int, ...] = ()
        self.dists: tuple[SparseProbs, ...] | None = None
        self.seconds = 0.0
        self._done = False

    def run(self) -> None:
        """Draft the block ahead (once: a retried exchange keeps it)."""
        if self._done:  # a retried exchange after a reconnect: the block is still valid
            return
        t0 = time.perf_counter()
        if self.free:
            tree = self.work.free(self.context, 1 + self.k)
            if tree is not None:
                self.tokens, self.dists = tree.tokens, tree.dists
        else:
            self.tokens, self.dists = self.work.draft(self.context, 1 + self.k)
        self.seconds = time.perf_counter() - t0
        self._done = True

    def matches(self, history: list[int]) -> bool:
        """Whether the block drafted ahead continues ``history``: the verdict kept
        everything and its own token was the guess."""
        return (self._done and bool(self.tokens) and len(history) == len(self.context) + 1
                and history[-1] == self.tokens[0] and history[:-1] == self.context)

    def block(self, limit: int) -> Tree:
        """The next round's draft from the block ahead, at most ``limit`` tokens."""
        n = min(self.k, limit)
        return Tree.of_chain(self.tokens[1:1 + n],
                             self.dists[1:1 + n] if self.dists is not None else None)


class BlockAhead(Rounds):
    """Rounds that draft the next block while the verdict is in flight, as if every token
    will be accepted, guessing that the bonus token is the draft's own next token.
    Drafting is a function of the history and the position only, so a block drafted ahead
    is exactly the block that would be drafted later: lossless by construction. When the
    verdict agrees (a hit) the next round sends at once. With token trees, the block
    ahead follows the tree's main chain, and is sent as a chain."""

    proactive = True

    def __init__(self, work: Work, k_max: int, adaptive: bool, width: int = 0) -> None:
        super().__init__(work, k_max, adaptive, width)
        self.ahead: Ahead | None = None
        self.hit = False

    def draft(self, history: list[int], limit: int, room: int) -> Tree:
        ahead = self.ahead
        self.hit = ahead is not None and ahead.matches(history)
        if ahead is not None and self.hit and len(ahead.tokens) > 1:  # (a free block may
            self.free_round = ahead.free  # end at the guess: then it is drafted anew)
            return ahead.block(limit)
        return super().draft(history, limit, room)

    def send(self, out: Emitter, tree: Tree) -> tuple[m.Verdict, float]:
        stats = self.work.stats
        chain = tree.trunk().tokens
        limit = min(out.remaining, out.room) - len(chain) - 2  # the next round's, on a hit
        ahead = self.ahead = (Ahead(self.work, [*out.history, *chain],
                                    self.choose(limit, self.round_policy), self.free_round)
                              if limit > 0 else None)
        verdict = self.verdict(out.history, tree, ahead.run if ahead else None)
        seconds = ahead.seconds if ahead else 0.0
        stats.draft_steps += len(ahead.tokens) if ahead else 0
        stats.draft_s += seconds
        stats.proactive_rounds += 1
        stats.proactive_hits += int(self.hit)
        return verdict, seconds


class CloudOnly:
    """The server generates every token and streams it, a frame per step; the edge only
    reads. The baseline speculative decoding has to beat, and the ground stream drafting
    stands on."""

    streams = True

    def __init__(self, work: Work) -> None:
        self.work = work
        self.requested = False  # the generation under way was asked for on this connection

    def request(self, out: Emitter, greeted_now: bool) -> bytes | None:
        """The ``Generate`` frame asking the server to generate from the history, or None
        while the generation asked for on this connection is under way."""
        if self.requested and not greeted_now:
            return None  # the stream is under way: only read
        self.requested = True
        self.restarted()
        return self.work.session.generate(out.history, min(out.remaining, out.room),
                                          self.work.params.stop_token_ids)

    def restarted(self) -> None:
        """A generation was asked for (again) from the current history."""

    def step(self, out: Emitter) -> list[Piece]:
        reply = self.work.link.exchange(self.work.session,
                                        lambda greeted_now: self.request(out, greeted_now),
                                        self.work.stats)
        return [self.received(reply)]

    def received(self, reply: Reply) -> Piece:
        """The piece a ``Tokens`` reply brings, its time recorded as a target pass."""
        assert isinstance(reply, m.Tokens)
        self.work.stats.record_pass(reply.compute_s)
        # drafted: the hinted tokens the server verified in this step (a round, recorded as
        # it is emitted)
        return Piece(reply.token_ids, reply.accepted, reply.done, reply.logprobs,
                     reply.prompt_logprobs, drafted=reply.drafted or None)


class StreamDrafting(CloudOnly):
    """Cloud-only generation that the edge speeds up without ever waiting: while the
    tokens stream back it keeps a draft past what it received and sends the new part in
    :class:`~spececd.protocol.messages.Hint` frames; before each step the server verifies
    the part of the latest hint ahead of its position. A round trip costs stale hints, not
    idle time, and the output is the target's own for the seed (match verification,
    randomness per position). The draft reaches ``ahead`` tokens past where the server will
    be when a hint arrives (:func:`~spececd.core.policy.stream_lookahead`: the measured
    round trip over the server's step), so a longer link drafts deeper.

    A hint goes out after every half server step's worth of drafting (measured: the
    server's lone steps against this drafter's), so a fast drafter sends fuller hints and
    a slow one sends them early. When the server keeps none of the hints for a while
    (they arrive after it has generated past them, on a round trip longer than the
    lookahead, or the draft does not follow the target), the ``gate`` stops drafting for a
    while: the edge then costs what cloud-only generation costs.

    With token trees (``tree_width`` > 1, a server that takes them in hints) a hint also
    carries other candidates where the draft is unsure (:func:`~spececd.core.policy.
    hint_shape`, from the share of hinted tokens the server keeps and what a verified
    position costs it): where the target's token is not the hinted one, it may be one of
    those, and the step keeps it.

    What it measures of the server's steps, the hints' acceptance and the draft's speed
    also goes to ``estimate``, which outlives the generation: what rounds would bring on
    this link (for ``--proactive auto``). Within ``--proactive auto`` a ``hints`` chooser
    also decides, from the tokens per second each brings, whether to send hints at all
    or let the server generate alone (cloud-only generation), at any step.

    Where the draft costs nothing (a lookup, a prediction:
    :meth:`~spececd.edge.drafter.DraftSource.free`) it reaches ``width`` tokens (the
    server's pass width) instead of ``ahead``, sent at once."""

    def __init__(self, work: Work, ahead: int, gate: HintGate | None = None,
                 estimate: RoundsEstimate | None = None,
                 hints: StrategyChooser | None = None, width: int = 0) -> None:
        super().__init__(work)
        self.ahead, self.width = ahead, max(ahead, width)
        self.gate = gate or HintGate()  # closed while hints keep arriving too late
        self.estimate = estimate
        # --proactive auto: hints (Arm.STREAM) or none (Arm.CLOUD), whichever brings more
        # tokens per second here; None: always hints (as the gate allows). The server
        # alone is not measured while hints bring more than its step allows
        # (RoundsEstimate.cloud_cap: measured on steps without hints, the edge's overhead
        # left out, so erring for it, and a margin).
        self.hints = hints
        self.hinted = False  # whether the last exchange had hints out or sent one
        self.arm = hints.start() if hints is not None else Arm.STREAM
        self.settled = math.inf  # when a change of arm has reached back here (perf_counter)
        self.prefill = False  # the next step also runs over the context it was asked from
        self.draft: list[int] = []  # drafted tokens after the history
        self.sent = 0  # how many of them the server has been sent
        self.draft_step, self.server_step = Ema(0.0), Ema(0.0)  # one draft token; a lone step
        self.kept = Ema(0.7)  # the share of the hinted tokens a step verified that it kept
        self.step_fit = LinearFit()  # a step's seconds against the hinted depth it verified
        self.breadth = Ema(1.0)  # candidates per hinted position (1: chains)

    def restarted(self) -> None:
        self.sent = 0  # a new connection's generation has no hints yet
        self.prefill = True
        self.settled = math.inf  # from the first tokens on (the request's prefill is no arm's)

    def received(self, reply: Reply) -> Piece:
        piece = super().received(reply)
        assert isinstance(reply, m.Tokens)
        if self.estimate is not None and not self.prefill:
            self.estimate.step(reply.drafted, reply.accepted, reply.compute_s)
        self.prefill = False
        self.gate.step(len(reply.token_ids), kept=reply.accepted > 0, hinted=self.sent > 0)
        ids = list(reply.token_ids)
        if self.draft[:len(ids)] == ids:  # the target agreed with the draft so far
            del self.draft[:len(ids)]
            self.sent = max(0, self.sent - len(ids))
        else:
            self.draft, self.sent = [], 0
        if not reply.drafted and reply.compute_s > 0:
            self.server_step.update(reply.compute_s)
        if reply.drafted:
            self.kept.update(reply.accepted / reply.drafted)
        if reply.compute_s > 0:
            self.step_fit.update(reply.drafted, reply.compute_s)
        return piece

    def lookahead(self, depth: int) -> int:
        """How far past the last token received to draft ``depth`` tokens ahead of the
        server (:func:`~spececd.core.policy.stream_lookahead`: from the round trip and the
        server's step time, at most the server's ``max_draft``), no deeper than the
        server's budget past where it will be (it verifies no more of a hint in a step)."""
        session = self.work.session
        welcome, budget = session.welcome, session.budget
        if budget == 0:
            return 0  # the server verifies no hint now: draft nothing
        depth = depth if budget is None else min(depth, budget)
        return stream_lookahead(depth, self.work.link.rtt.value, self.server_step.value,
                                welcome.max_draft if welcome is not None else self.ahead)

    def step(self, out: Emitter) -> list[Piece]:
        if self.hints is None:
            return self.exchange(out)
        if self.estimate is not None:  # the server's own step bounds what it alone brings
            self.hints.cap(Arm.CLOUD, self.estimate.cloud_cap())
        t0 = time.perf_counter()
        pieces = self.exchange(out)
        now = time.perf_counter()
        tokens = sum(len(piece.tokens) for piece in pieces)
        if self.settled == math.inf and tokens:
            self.settled = now  # the generation's first tokens: measured from here
        elif t0 >= self.settled and (self.hinted or self.arm is Arm.CLOUD):
            # An exchange of the hints arm that had no hint out and sent none (the gate
            # closed, a budget of 0, nothing to draft) is the server alone's: it counts for
            # neither arm, so that the hints arm's speed is that of the exchanges hints
            # can change. Over whole generations, not stage by stage: either arm runs anywhere in a
            # generation, so a probe speaks for now, where a stage's old speeds would
            # outweigh it until measured there again.
            arm = self.hints.record(self.arm, tokens, now - t0)
            if arm is not self.arm:
                # What the server does changes when the switch reaches it, and what the
                # edge receives half a round trip later: neither arm's until then.
                self.arm, self.settled = arm, now + self.work.link.rtt.value
        return pieces

    def exchange(self, out: Emitter) -> list[Piece]:
        """One exchange: draft ahead and send a hint, taking whatever tokens have arrived,
        or, when there is nothing to draft (or hints are off), wait for the next tokens."""
        room = min(out.remaining, out.room) - 1
        want = min(self.lookahead(self.ahead), room) - len(self.draft)
        wide = (min(self.lookahead(self.width), room) - len(self.draft)
                if self.width > self.ahead else want)  # for a draft that costs nothing
        self.hinted = self.sent > 0  # hints out: the server's steps may verify them
        if not (self.requested and wide > 0 and self.gate.open and self.arm is Arm.STREAM
                and self.work.link.transport is not None):
            return super().step(out)  # ask for the generation, or wait for the next tokens
        work = self.work
        history = [*out.history, *self.draft]
        t0 = time.perf_counter()
        free = work.free(history, wide) if wide > want else None
        alternatives: tuple[tuple[int, int], ...] = ()
        if free is not None:
            tokens = free.trunk().tokens
        elif want <= 0:
            return super().step(out)
        else:
            draft_step, server_step = self.draft_step.value, self.server_step.value
            chunk = (round(STREAM_CHUNK_OF_STEP * server_step / draft_step)
                     if draft_step and server_step else 2)
            tokens, alternatives = self.drafted(history, max(1, min(chunk, want)))
        seconds = time.perf_counter() - t0
        if free is None:  # the draft model's pace (free tokens cost none of it)
            self.draft_step.update(seconds / max(1, len(tokens)))
            if self.estimate is not None:
                self.estimate.drafted(len(tokens), seconds)
        work.stats.draft_s += seconds
        work.stats.draft_steps += len(tokens)
        work.stats.tree_siblings += len(alternatives)
        if not tokens:  # a lookup that found nothing: no hint, wait for the next tokens
            return super().step(out)
        offset = len(self.draft) - self.sent  # where this draft begins in the hint
        self.draft.extend(tokens)
        hint = work.session.hint(len(out.history) + self.sent, self.draft[self.sent:],
                                 tuple((offset + i, t) for i, t in alternatives))
        self.sent = len(self.draft)
        self.hinted = True
        return [self.received(reply)
                for reply in work.link.send_and_poll(work.session, hint, work.stats)]

    def drafted(self, history: list[int], n: int
                ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """``n`` drafted tokens after ``history``, and other candidates ``(i, token)`` for
        the ``i``-th of them where the server takes trees in hints."""
        work = self.work
        if work.tree_width == 1 or not work.session.hint_trees:
            return work.draft(history, n)[0], ()
        assert work.params.seed is not None
        # What one more verified position costs: per depth of the hints, over the
        # candidates per depth they carried.
        shape = hint_shape(work.tree_width, n, len(self.draft), self.kept.value,
                           self.step_fit.slope / self.breadth.value, self.server_step.value)
        before = work.free_counts()
        tree = work.drafter.tree(history, n, shape, work.mode, work.params, work.params.seed,
                                 work.max_support)
        work.count_free(before)
        self.breadth.update(len(tree.tokens) / max(1, len(tree.chain)))
        return tree.trunk().tokens, tree.siblings()


class Adaptive:
    """``--proactive auto`` against a server: rounds (in the session's mode) or streaming
    (by match, on a session of its own on the same link, whose cache the server shares),
    whichever the ``chooser`` finds faster on this link; within rounds, block-ahead or
    plain, whichever the ``rounds_chooser`` finds faster; within streaming, hints or none
    (cloud-only generation), whichever the ``hints_chooser`` finds faster, switched at any
    step (:class:`StreamDrafting`). Rounds' kept drafts go to ``estimate`` too. All are
    lossless, so the output's distribution does not depend on the choice (for a seed, the
    tokens may, as with ``k`` auto in exact mode). A generation under way switches at once
    between the kinds of rounds, to streaming, and from streaming back to rounds (the edge
    leaves the stream, :meth:`~spececd.edge.link.Link.leave_stream`: it keeps the tokens
    that arrived, a prefix of the server's, and greets again). Streaming feeds ``estimate``,
    what rounds would bring, with which the client spares the chooser probes of rounds
    that cannot win (:meth:`~spececd.edge.client.EdgeClient.bound_rounds`)."""

    def __init__(self, rounds: Work, stream: Work, chooser: StrategyChooser,
                 rounds_chooser: StrategyChooser, hints_chooser: StrategyChooser,
                 gate: HintGate, estimate: RoundsEstimate, arm: Arm, k_max: int,
                 adaptive: bool, width: int = 0) -> None:
        self.stream_work, self.chooser, self.gate = stream, chooser, gate
        self.estimate = estimate
        self.rounds_chooser, self.hints_chooser = rounds_chooser, hints_chooser
        self.arm, self.k_max, self.width = arm, k_max, width
        self.rounds: dict[Arm, Rounds] = {
            Arm.AHEAD: BlockAhead(rounds, k_max, adaptive, width),
            Arm.PLAIN: Rounds(rounds, k_max, adaptive, width)}
        self.kind = rounds_chooser.start()  # the kind of rounds
        self.current: Strategy = (self.rounds[self.kind] if arm is Arm.ROUNDS
                                  else self.streaming())
        # The first exchange of an arm carries one-off costs (the prompt's prefill, a new
        # hello, the request of a stream) that would make whichever arm starts a
        # generation look slower: it is not measured. Nor is the first round of a kind of
        # rounds switched to (block-ahead has no block drafted ahead yet, and with k auto
        # the kind's own draft-length policy starts cold).
        self.warm = self.kind_warm = False

    @property
    def streams(self) -> bool:
        return self.arm is Arm.STREAM or self.stream_work.link.leaving

    def streaming(self) -> StreamDrafting:
        """The server generating from the history as it stands: with hints, or without
        (cloud-only generation), whichever the ``hints_chooser`` finds faster."""
        return StreamDrafting(self.stream_work, self.k_max, self.gate, self.estimate,
                              self.hints_chooser, self.width)

    def step(self, out: Emitter) -> list[Piece]:
        position = out.generated  # the arms are compared stage by stage of a generation
        t0 = time.perf_counter()
        current = self.current
        pieces = current.step(out)
        seconds = time.perf_counter() - t0
        tokens = sum(len(piece.tokens) for piece in pieces)
        stats = self.stream_work.stats
        if self.arm is Arm.STREAM:  # of which the server alone's: no hint out, none sent
            stats.auto_stream_tokens += tokens
            hinted = isinstance(current, StreamDrafting) and current.hinted
            stats.auto_cloud_tokens += 0 if hinted else tokens
        elif self.kind is Arm.PLAIN:
            stats.auto_plain_tokens += tokens
        if isinstance(current, Rounds):  # what rounds keep, for the estimate of rounds
            for piece in pieces:
                self.estimate.round(piece.drafted or 0, piece.from_draft)
        if not self.warm:
            self.warm = self.kind_warm = bool(pieces)
            return pieces
        arm = self.chooser.record(self.arm, tokens, seconds, position)
        if self.arm is Arm.STREAM:
            # Mid-generation: leave the stream, go on from here; not under a constraint,
            # whose rounds a server may refuse past the prompt (vLLM's runner).
            if arm is Arm.ROUNDS and self.stream_work.session.hello_message.constraint is None:
                self.stream_work.link.leave_stream()
                self.arm, self.warm = arm, False
                self.current = self.rounds[self.kind]
                self.current.cold = True  # its first round's wait is the switch's
            return pieces
        kind = self.kind
        if self.kind_warm:
            kind = self.rounds_chooser.record(self.kind, tokens, seconds, position)
        self.kind_warm = True
        if arm is Arm.STREAM:
            self.arm, self.warm = arm, False
            self.current = self.streaming()
        elif kind is not self.kind:  # the same session: no hello, no prefill
            self.kind, self.current, self.kind_warm = kind, self.rounds[kind], False
        return pieces


class DraftAlone:
    """The fallback: the draft alone (the draft model where one is loaded, else the
    lookup), a token at a time, unverified."""

    streams = False

    def __init__(self, drafter: DraftSource, params: SamplingParams,
                 stats: GenerationStats) -> None:
        self.drafter, self.params, self.stats = drafter, params, stats

    def step(self, out: Emitter) -> list[Piece]:
        assert self.params.seed is not None
        t0 = time.perf_counter()
        tokens, _ = self.drafter.draft(out.history, 1, Mode.MATCH, self.params, self.params.seed,
                                       max_support=1)  # unused: match mode reports nothing
        if not tokens:  # another tokenizer that cannot realign here, or nothing to look up
            raise SpecECDError("the verifier is unreachable and the draft cannot go on alone "
                               "here (a draft model whose text does not realign with the "
                               "target's tokens, or a lookup that finds nothing to propose)")
        self.stats.draft_s += time.perf_counter() - t0
        self.stats.draft_steps += 1
        return [Piece(tokens)]
