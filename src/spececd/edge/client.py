"""The edge's generation loop: draft, send, apply the verdict, emit, repeat.

The edge holds the authoritative token history. Each round it drafts ``k`` tokens, sends
them through an :class:`~spececd.protocol.session.EdgeSession` over any transport, and
appends the verdict's accepted tokens plus the verifier's own token to the history. Stop
tokens and ``max_tokens`` are applied here, exactly (:func:`clip_emitted`), and ``k`` is
cut so that no round drafts past the token budget.

The link is kept open across generations. When it fails (``ConnectionError`` from the
transport) the client reconnects with exponential backoff, greets the server again and
re-sends the draft with the whole history as its prefix; randomness depends only on
(seed, position), so the verdict, and the output, are those of an uninterrupted run.
When the verifier stays unreachable the client raises :class:`CloudUnreachable`, or, with
``fallback="draft"``, finishes the generation with the draft model alone and says so.

The loop does not know whether the verifier is in this process or across the world.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from spececd.core.policy import DraftLengthPolicy, Ema
from spececd.core.sampling import Mode, SamplingParams, SparseProbs
from spececd.core.stats import GenerationStats
from spececd.core.stopping import clip_emitted
from spececd.edge.drafter import Drafter
from spececd.edge.options import Reconnect
from spececd.errors import SpecECDError
from spececd.protocol import messages as m
from spececd.protocol.messages import Fingerprint
from spececd.protocol.session import EdgeSession
from spececd.transports.base import Transport

log = logging.getLogger(__name__)

STREAM_CHUNK_OF_STEP = 0.5  # stream drafting: a hint every half server step of drafting


class CloudUnreachable(SpecECDError):
    """The verifier could not be reached, after every reconnection attempt."""


@dataclass(frozen=True)
class RoundOutput:
    """Tokens one round emitted: the first ``from_draft`` are accepted drafts, the rest
    (at most one) came from the target; ``fallback`` rounds were never verified."""

    token_ids: tuple[int, ...]
    from_draft: int
    finished: bool
    fallback: bool = False


class Ahead:
    """A block drafted ahead, while a verdict is in flight: the bonus-token guess followed
    by the next round's draft, valid if the verdict accepts everything and its own token
    equals the guess."""

    def __init__(self, drafter: Drafter, context: list[int], mode: Mode,
                 params: SamplingParams, k: int) -> None:
        self.drafter, self.context, self.mode, self.params, self.k = (
            drafter, context, mode, params, k)
        self.tokens: tuple[int, ...] = ()
        self.dists: tuple[SparseProbs, ...] | None = None
        self.seconds = 0.0
        self._done = False

    def run(self) -> None:
        if self._done:  # a retried exchange after a reconnect: the block is still valid
            return
        assert self.params.seed is not None
        t0 = time.perf_counter()
        self.tokens, self.dists = self.drafter.draft(self.context, 1 + self.k, self.mode,
                                                     self.params, self.params.seed)
        self.seconds = time.perf_counter() - t0
        self._done = True

    def matches(self, history: list[int]) -> bool:
        return (self._done and len(history) == len(self.context) + 1
                and history[-1] == self.tokens[0] and history[:-1] == self.context)

    def block(self, limit: int) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        n = min(self.k, limit)
        return self.tokens[1:1 + n], (self.dists[1:1 + n] if self.dists is not None else None)


class EdgeClient:
    def __init__(self, drafter: Drafter, connect: Callable[[], Transport],
                 fingerprint: Fingerprint, max_context: int, auth_token: str = "",
                 reconnect: Reconnect | None = None, fallback: str = "none",
                 proactive: bool = False, k_max: int = 8) -> None:
        if fallback not in ("none", "draft"):
            raise ValueError(f"fallback must be 'none' or 'draft', got {fallback!r}")
        self.drafter = drafter
        self.connect = connect
        self.fingerprint = fingerprint
        self.max_context = max_context
        self.auth_token = auth_token
        self.reconnect = reconnect or Reconnect()
        self.fallback = fallback
        self.proactive = proactive  # draft the next block while a verdict is in flight
        self.k_max = k_max  # the adaptive policy's largest draft
        self._transport: Transport | None = None
        self._greeted: EdgeSession | None = None
        self._welcome: m.Welcome | None = None

    def close(self) -> None:
        if self._transport is not None:
            with contextlib.suppress(ConnectionError):
                self._transport.send(m.encode(m.Close("bye")))
            self._drop()

    def _drop(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport, self._greeted = None, None

    def _exchange(self, session: EdgeSession, make_frame: Callable[[bool], bytes | None] | None,
                  stats: GenerationStats, while_waiting: Callable[[], None] | None = None
                  ) -> m.Welcome | m.Verdict | m.Tokens:
        """Greet the server if this session has not, send ``make_frame(greeted_now)`` (None:
        send nothing, a stream is under way), run ``while_waiting`` while the reply is on its
        way, and return the reply; reconnect and retry when the link fails."""
        failures = 0
        while True:
            transport = self._transport
            sent = received = 0
            try:
                if transport is None:
                    transport = self._transport = self.connect()
                sent, received = transport.bytes_sent, transport.bytes_received
                greeted_now = self._greeted is not session
                if greeted_now:
                    transport.send(session.hello(checked=self._greeted is not None))
                    welcome = session.receive(transport.recv())
                    assert isinstance(welcome, m.Welcome)
                    self._greeted, self._welcome = session, welcome
                if make_frame is None:
                    assert self._welcome is not None
                    return self._welcome
                start = time.perf_counter()
                frame = make_frame(greeted_now)
                if frame is not None:
                    transport.send(frame)
                overlapped = 0.0
                if while_waiting is not None:
                    t0 = time.perf_counter()
                    while_waiting()
                    overlapped = time.perf_counter() - t0
                reply = session.receive(transport.recv())
                if isinstance(reply, m.Verdict):  # the part of the round trip nothing hid
                    stats.network_s += max(0.0, time.perf_counter() - start - reply.verify_s
                                           - overlapped)
                return reply
            except ConnectionError as exc:
                self._drop()
                failures += 1
                if failures > self.reconnect.attempts:
                    raise CloudUnreachable(
                        f"cannot reach the verifier after {self.reconnect.attempts} "
                        f"reconnection attempts ({exc}); check that `spececd serve` runs at "
                        f"that address, or pass --fallback draft") from None
                stats.reconnects += 1
                wait = min(self.reconnect.delay * 2 ** (failures - 1), self.reconnect.max_delay)
                log.warning("link to the verifier failed (%s); reconnecting in %.2f s", exc, wait)
                time.sleep(wait)
            finally:
                if transport is not None:
                    stats.bytes_sent += transport.bytes_sent - sent
                    stats.bytes_received += transport.bytes_received - received

    def rounds(self, prompt_ids: list[int], params: SamplingParams, mode: Mode, k: int | None,
               stats: GenerationStats) -> Iterator[RoundOutput]:
        """Generate after ``prompt_ids`` (``params.seed`` must be set), one round at a time.
        ``k=None`` chooses the draft length each round (:class:`DraftLengthPolicy`)."""
        assert params.seed is not None
        seed = params.seed
        session = EdgeSession(self.fingerprint, mode, params, self.auth_token)
        history = list(prompt_ids)
        generated = 0
        start = time.perf_counter()
        try:
            welcome = self._exchange(session, None, stats)
            assert isinstance(welcome, m.Welcome)
            max_context = min(self.max_context, welcome.max_context)
            k_max = min(k or self.k_max, welcome.max_draft)
            policy = (DraftLengthPolicy(k_max=k_max, k_initial=min(4, k_max),
                                        proactive=self.proactive) if k is None else None)
            ahead: Ahead | None = None
            while True:
                remaining = params.max_tokens - generated
                room = max_context - len(history)  # positions left, the verifier's token included
                limit = max(0, min(remaining - 1, room - 1))
                hit = ahead is not None and ahead.matches(history)
                t0 = time.perf_counter()
                if ahead is not None and hit:
                    tokens, dists = ahead.block(limit)
                else:
                    k_round = policy.choose(limit) if policy else min(k_max, limit)
                    tokens, dists = self.drafter.draft(history, k_round, mode, params, seed)
                    stats.draft_steps += len(tokens)
                draft_s = time.perf_counter() - t0
                # While the verdict is in flight, draft the next block as if every token is
                # accepted, guessing the bonus token; drafting is a pure function of the
                # history and the position, so a block used later is the one we would draft.
                next_limit = min(remaining - len(tokens) - 1, room - len(tokens) - 1) - 1
                ahead = (Ahead(self.drafter, [*history, *tokens], mode, params,
                               policy.choose(next_limit) if policy else min(k_max, next_limit))
                         if self.proactive and next_limit > 0 else None)
                frame = functools.partial(session.draft, history, tokens, dists)
                round_start = time.perf_counter()
                verdict = self._exchange(session, lambda _, f=frame: f(), stats,  # type: ignore[misc]
                                         while_waiting=ahead.run if ahead else None)
                round_s = time.perf_counter() - round_start
                assert isinstance(verdict, m.Verdict)
                ahead_s = ahead.seconds if ahead else 0.0
                stats.draft_steps += len(ahead.tokens) if ahead else 0
                stats.draft_s += draft_s + ahead_s
                stats.record_round(len(tokens), verdict.num_accepted)
                stats.verify_s += verdict.verify_s
                if self.proactive:
                    stats.proactive_rounds += 1
                    stats.proactive_hits += int(hit)
                if policy is not None:
                    policy.observe(len(tokens), verdict.num_accepted, draft_s, verdict.verify_s,
                                   round_s - verdict.verify_s - ahead_s)
                emitted = (*tokens[:verdict.num_accepted], verdict.next_token)
                history.extend(emitted)
                out, finished = clip_emitted(emitted, params.stop_token_ids, remaining)
                generated += len(out)
                stats.generated += len(out)
                finished = finished or len(history) >= max_context
                yield RoundOutput(tuple(out), min(verdict.num_accepted, len(out)), finished)
                if finished:
                    return
        except CloudUnreachable:
            if self.fallback != "draft":
                raise
            yield from self._draft_alone(history, generated, params, stats)
        finally:
            stats.wall_s += time.perf_counter() - start

    def cloud_rounds(self, prompt_ids: list[int], params: SamplingParams,
                     stats: GenerationStats) -> Iterator[RoundOutput]:
        """Cloud-only generation: the server generates every token and streams it; the edge
        only reads (the baseline speculative decoding has to beat)."""
        assert params.seed is not None
        session = EdgeSession(self.fingerprint, Mode.MATCH, params, self.auth_token)
        history = list(prompt_ids)
        generated = 0
        start = time.perf_counter()

        def request(greeted_now: bool) -> bytes | None:
            if not (greeted_now or (generated == 0 and not requested)):
                return None  # the stream is under way: only read
            requested.append(True)
            room = max_context - len(history)
            return session.generate(history, min(params.max_tokens - generated, room),
                                    params.stop_token_ids)

        requested: list[bool] = []
        try:
            welcome = self._exchange(session, None, stats)
            assert isinstance(welcome, m.Welcome)
            max_context = min(self.max_context, welcome.max_context)
            while True:
                reply = self._exchange(session, request, stats)
                assert isinstance(reply, m.Tokens)
                stats.verify_s += reply.compute_s
                history.extend(reply.token_ids)
                out, finished = clip_emitted(reply.token_ids, params.stop_token_ids,
                                             params.max_tokens - generated)
                generated += len(out)
                stats.generated += len(out)
                finished = finished or reply.done
                yield RoundOutput(tuple(out), 0, finished)
                if finished:
                    return
        finally:
            stats.wall_s += time.perf_counter() - start

    def stream_rounds(self, prompt_ids: list[int], params: SamplingParams, k: int | None,
                      stats: GenerationStats) -> Iterator[RoundOutput]:
        """Stream drafting: the server generates as in :meth:`cloud_rounds`, never waiting
        for the edge, while the edge keeps a draft of the tokens ahead of what it has
        received and sends it in :class:`~spececd.protocol.messages.Hint` frames; before
        each step the server verifies the part of the latest hint ahead of its position.
        A round trip costs the edge nothing but stale hints, and the output is the
        target's own for the seed (match verification with per-position randomness).

        ``k``: how many tokens ahead of the received ones to draft (``None``: ``k_max``).
        A hint goes out after every half server step's worth of drafting (measured: the
        server's own steps against this drafter's), so a fast drafter sends fuller hints
        and a slow one sends them early."""
        assert params.seed is not None
        seed = params.seed
        mode = Mode.MATCH  # verified by match: drafts travel without distributions
        session = EdgeSession(self.fingerprint, mode, params, self.auth_token)
        history = list(prompt_ids)
        draft: list[int] = []  # drafted tokens after `history`
        sent = 0  # how many of them the server has been sent
        generated = 0
        requested = False
        draft_step, server_step = Ema(0.0), Ema(0.0)  # one draft token; a lone server step
        start = time.perf_counter()

        def request(greeted_now: bool) -> bytes | None:
            nonlocal requested, sent
            if requested and not greeted_now:
                return None  # the stream is under way: only read
            requested, sent = True, 0  # a new link's generation has no hints yet
            room = max_context - len(history)
            return session.generate(history, min(params.max_tokens - generated, room),
                                    params.stop_token_ids)

        try:
            welcome = self._exchange(session, None, stats)
            assert isinstance(welcome, m.Welcome)
            max_context = min(self.max_context, welcome.max_context)
            ahead = min(k or self.k_max, welcome.max_draft)
            replies: list[m.Welcome | m.Verdict | m.Tokens] = [
                self._exchange(session, request, stats)]
            while True:
                for reply in replies:
                    assert isinstance(reply, m.Tokens)
                    ids = list(reply.token_ids)
                    if draft[:len(ids)] == ids:  # the target agreed with the draft so far
                        del draft[:len(ids)]
                        sent = max(0, sent - len(ids))
                    else:
                        draft, sent = [], 0
                    history.extend(ids)
                    stats.verify_s += reply.compute_s
                    if not reply.drafted and reply.compute_s > 0:
                        server_step.update(reply.compute_s)
                    if reply.drafted:
                        stats.record_round(reply.drafted, reply.accepted)
                    out, finished = clip_emitted(ids, params.stop_token_ids,
                                                 params.max_tokens - generated)
                    generated += len(out)
                    stats.generated += len(out)
                    finished = finished or reply.done
                    yield RoundOutput(tuple(out), min(reply.accepted, len(out)), finished)
                    if finished:
                        return
                room = min(params.max_tokens - generated, max_context - len(history)) - 1
                want = min(ahead, room) - len(draft)
                transport = self._transport
                if want > 0 and transport is not None:
                    chunk = (round(STREAM_CHUNK_OF_STEP * server_step.value / draft_step.value)
                             if draft_step.value and server_step.value else 2)
                    t0 = time.perf_counter()
                    tokens, _ = self.drafter.draft([*history, *draft],
                                                   max(1, min(chunk, want)), mode, params, seed)
                    seconds = time.perf_counter() - t0
                    draft_step.update(seconds / max(1, len(tokens)))
                    stats.draft_s += seconds
                    stats.draft_steps += len(tokens)
                    draft.extend(tokens)
                    replies = self._stream_io(session.hint(len(history) + sent, draft[sent:]),
                                              stats)
                    sent = len(draft)
                else:
                    replies = [self._exchange(session, request, stats)]
        except CloudUnreachable:
            if self.fallback != "draft":
                raise
            yield from self._draft_alone(history, generated, params, stats)
        finally:
            stats.wall_s += time.perf_counter() - start

    def _stream_io(self, frame: bytes, stats: GenerationStats
                   ) -> list[m.Welcome | m.Verdict | m.Tokens]:
        """Send a hint and take whatever has arrived, without waiting. A failed link is
        dropped here and re-established by the next blocking exchange."""
        transport = self._transport
        assert transport is not None and self._greeted is not None
        sent, received = transport.bytes_sent, transport.bytes_received
        replies: list[m.Welcome | m.Verdict | m.Tokens] = []
        try:
            transport.send(frame)
            while (data := transport.poll()) is not None:
                replies.append(self._greeted.receive(data))
        except ConnectionError as exc:
            log.warning("link to the verifier failed (%s); reconnecting", exc)
            stats.reconnects += 1
            self._drop()
        finally:
            stats.bytes_sent += transport.bytes_sent - sent
            stats.bytes_received += transport.bytes_received - received
        return replies

    def _draft_alone(self, history: list[int], generated: int, params: SamplingParams,
                     stats: GenerationStats) -> Iterator[RoundOutput]:
        assert params.seed is not None
        log.warning("the verifier is unreachable: finishing with the draft model alone "
                    "(this output is the draft's, not the target's)")
        stats.fallback = True
        while True:
            t0 = time.perf_counter()
            (token,), _ = self.drafter.draft(history, 1, Mode.MATCH, params, params.seed)
            stats.draft_s += time.perf_counter() - t0
            stats.draft_steps += 1
            history.append(token)
            out, finished = clip_emitted([token], params.stop_token_ids,
                                         params.max_tokens - generated)
            generated += len(out)
            stats.generated += len(out)
            stats.fallback_tokens += len(out)
            finished = finished or len(history) >= self.max_context
            yield RoundOutput(tuple(out), 0, finished, fallback=True)
            if finished:
                return
