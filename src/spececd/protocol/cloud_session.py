"""The verifier's side of a session, sans-I/O in the style of h11 and python-websockets:
bytes in, typed events out, bytes to send.

:class:`CloudSession` (one per connection on the verifier) validates every frame against
the session state and the server's limits::

    session.receive_data(frame)
    for request in session.events_received():   # VerifyRequest | GenerateRequest
        ... run it on the target, then session.verdict(...) or session.tokens(...)
    for reply in session.data_to_send():        # welcome, verdicts, tokens, errors
        ... send it

A valid draft becomes a :class:`VerifyRequest` for whoever owns the target model, a valid
generate a :class:`GenerateRequest` (and opens a :class:`Stream` that later hints feed);
the model's answers go back through :meth:`CloudSession.verdict` and
:meth:`CloudSession.tokens`, which queue the frames to send. Anything invalid queues an
``Error`` frame; a fatal one also closes the session. The machine never raises at its
caller for bad input, never awaits and never touches a model.

The server's context is only a cache of the edge's authoritative history: a draft says how
much of it it builds on (``context_len``) and what to append first (``prefix``), so after a
lost verdict, a reconnect or a server restart the edge re-sends and the result is the same.
"""

from __future__ import annotations

import enum
import hmac
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from spececd.core.logprobs import Logprobs
from spececd.core.params import Constraint, Mode, SamplingParams
from spececd.core.sampling import SparseProbs
from spececd.core.tokens import common_prefix
from spececd.core.verify import tree_depth
from spececd.protocol import messages as m
from spececd.protocol.errors import (
    AuthFailed,
    IncompatibleModels,
    InvalidConstraint,
    InvalidProbabilities,
    InvalidTokens,
    LimitExceeded,
    OutOfOrder,
    ProtocolError,
    UnexpectedMessage,
    Unsupported,
)

PROB_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Limits:
    """Server-side limits; every one is checked per message."""

    max_draft: int = 64
    max_context: int = 4096
    max_message_bytes: int = 1 << 20
    # The longest draft told to edges as the server's pass width (the Welcome's width): 0,
    # the runner's (CloudService fills it in), else at most this.
    pass_width: int = 0

    @property
    def width(self) -> int:
        """The pass width as edges are told it: :attr:`pass_width` within ``max_draft``."""
        return min(self.pass_width or self.max_draft, self.max_draft)


@dataclass(frozen=True)
class VerifyRequest:
    """A validated draft: verify ``tokens`` after ``context`` (never empty)."""

    seq: int
    context: tuple[int, ...]
    tokens: tuple[int, ...]
    draft_probs: tuple[SparseProbs, ...] | None
    mode: Mode
    params: SamplingParams
    threshold: float = 0.0  # threshold mode (lossy) only
    parents: tuple[int, ...] | None = None  # a tree's parent of each token; None: a chain
    # The first request after a hello that asked for the prompt's log-probabilities (echo):
    # computed over the whole context, and sent with the reply.
    prompt_logprobs: bool = False
    # A chain the scheduler's budget cut before its last token, which is decided at the row
    # before it with no row after (:func:`~spececd.core.verify.verify`, ``cut``).
    cut: bool = False
    # A step of a generation the server runs itself (cloud-only, or stream drafting): its
    # next step follows its verdict with no round trip to the edge.
    stepped: bool = False

    @property
    def scored(self) -> tuple[int, ...]:
        """The drafted tokens the target's forward scores the row after (a cut chain's
        last one has none)."""
        return self.tokens[:-1] if self.cut else self.tokens


@dataclass(frozen=True)
class GenerateRequest:
    """A validated cloud-only generation: up to ``max_tokens`` after ``context``."""

    seq: int
    context: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass
class Stream:
    """A cloud-only generation under way, and the edge's latest hint for it: drafted
    tokens for the positions from ``hint_start`` on. ``reach``: the position after the
    last token of the latest hint frame taken, whether or not it agrees with the context
    (how far ahead the edge has drafted, for the server's measure of its turnaround).
    ``alternatives``: other candidates for positions of the hint (leaf siblings of its
    tokens there), by position."""

    request: GenerateRequest
    generated: int = 0
    hint_start: int = 0
    hint: tuple[int, ...] = ()
    reach: int = 0
    alternatives: dict[int, tuple[int, ...]] = field(default_factory=dict)


class StepOut(NamedTuple):
    """A step of a generation, recorded (its ``Tokens`` frame is queued to send): whether
    the generation is over (``max_tokens`` or a stop token), the hint's tokens it verified,
    how many of them it kept, the tokens it emitted, and the step's compute time."""

    done: bool
    drafted: int
    accepted: int
    emitted: int
    seconds: float


Event = VerifyRequest | GenerateRequest  # what a frame asks the model's owner to run


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    READY = "ready"
    CLOSED = "closed"


class CloudSession:
    """``trees``: the target's backend verifies token trees (offered to protocol-4 edges).
    ``unsupported``: why the server's engine cannot serve a mode with some sampling
    settings ("" when it can), asked at every hello. ``constraint_error``: why a hello's
    constraint cannot be compiled ("" when it can; None: constraints are refused)."""

    def __init__(self, fingerprint: m.Fingerprint, limits: Limits, auth_token: str = "",
                 trees: bool = False,
                 unsupported: Callable[[Mode, SamplingParams], str] | None = None,
                 constraint_error: Callable[[Constraint], str] | None = None) -> None:
        self.fingerprint = fingerprint
        self.limits = limits
        self._auth_token = auth_token
        self._trees = trees
        self._unsupported = unsupported
        self._constraint_error = constraint_error
        self.trees = False  # this session's edge was told it may send trees
        self.budgets = False  # this session's edge reads the server's budget (protocol 7)
        self.state = State.AWAIT_HELLO
        self.session_id = secrets.token_hex(8)
        self.mode = Mode.GREEDY
        self.params = SamplingParams()
        self.threshold = 0.0
        self.lossy = False  # the edge asked for a lossy mode (labelled in the welcome)
        self.context: tuple[int, ...] = ()
        self.errors: Counter[str] = Counter()  # errors answered, by code
        self.request_seq = -1  # the seq of the last draft or generate request received
        self._last_seq = -1
        self._last_frame = b""  # the last draft frame, and the verdict frame it got
        self._last_verdict = b""
        self._checked = False  # a hello on this connection carried a matching fingerprint
        self.stream: Stream | None = None  # a cloud-only generation under way
        self._prompt_pending = False  # the prompt's log-probabilities are asked, not yet sent
        self._events: list[Event] = []
        self._outgoing: list[bytes] = []

    # -- input ------------------------------------------------------------------------
    def receive_data(self, frame: bytes) -> None:
        """Handle one frame: what it asks the model to do goes to :meth:`events_received`,
        what it is answered with (a welcome, a retransmitted verdict, an error) to
        :meth:`data_to_send`. A hint or a close changes the state only."""
        seq = self.request_seq = -1
        try:
            if len(frame) > self.limits.max_message_bytes:
                raise LimitExceeded(f"message of {len(frame)} bytes is over the limit of "
                                    f"{self.limits.max_message_bytes}")
            if frame == self._last_frame and self._last_verdict:
                self._outgoing.append(self._last_verdict)  # a retransmission: verify nothing
                return
            message = m.decode(frame)
            if isinstance(message, m.Draft):
                self._last_frame, self._last_verdict = frame, b""
            seq = message.seq if isinstance(message, (m.Draft, m.Generate)) else -1
            self.request_seq = seq
            self._handle(message)
        except ProtocolError as exc:
            self.send_error(exc, seq)

    def events_received(self) -> list[Event]:
        """The requests received since the last call, in order, for the model to run."""
        events, self._events = self._events, []
        return events

    def data_to_send(self) -> list[bytes]:
        """The frames to send since the last call, in order."""
        frames, self._outgoing = self._outgoing, []
        return frames

    def send_error(self, exc: ProtocolError, seq: int = -1) -> None:
        """Answer ``exc`` (a fatal one closes the session); the server's own errors, such
        as a failed verification or draining, go through here too."""
        self.errors[exc.code] += 1
        if exc.fatal:
            self.state, self.stream = State.CLOSED, None
        self._outgoing.append(m.encode(m.Error(exc.code, str(exc), seq, exc.fatal)))

    def _handle(self, message: m.Message) -> None:
        if isinstance(message, m.Close):  # closing a closed session changes nothing
            self.state, self.stream = State.CLOSED, None
            return
        if self.state is State.CLOSED:
            raise UnexpectedMessage("the session is closed; open a new connection")
        if isinstance(message, m.Hello):
            self._outgoing.append(self._hello(message))  # a first, or a new generation
        elif self.state is State.AWAIT_HELLO:
            raise UnexpectedMessage(f"expected hello first, got {type(message).__name__}")
        elif isinstance(message, m.Draft):
            self._events.append(self._draft(message))
        elif isinstance(message, m.Generate):
            self._events.append(self._generate(message))
        elif isinstance(message, m.Hint):
            self._hint(message)
        else:
            raise UnexpectedMessage(f"expected a draft, got {type(message).__name__}")

    def authorizes(self, token: str) -> bool:
        """Whether a hello with ``token`` passes this session's auth check."""
        return not self._auth_token or hmac.compare_digest(token.encode(),
                                                           self._auth_token.encode())

    def _hello(self, hello: m.Hello) -> bytes:
        hello.check_version()
        if not self.authorizes(hello.auth_token):
            raise AuthFailed("missing or wrong auth token")
        if hello.fingerprint == m.SAME_FINGERPRINT and self._checked:
            pass  # a later hello on this connection: the models were checked by the first
        elif hello.fingerprint != self.fingerprint:
            raise IncompatibleModels(
                f"draft and target tokenizers differ: the edge's has "
                f"{hello.fingerprint.vocab_size} tokens (hash "
                f"{hello.fingerprint.tokenizer_hash[:12]}), the server's "
                f"{self.fingerprint.vocab_size} (hash {self.fingerprint.tokenizer_hash[:12]}); "
                f"compared: the string of every token id (padding past the tokenizer is "
                f"not). Use a draft model with the target's tokenizer, or give the edge the "
                f"target's tokenizer (--target-tokenizer) to draft across the two")
        try:
            params = hello.params()
            if any(token >= self.fingerprint.vocab_size for token, _ in params.logit_bias):
                raise ValueError(f"logit_bias names token ids the vocabulary of "
                                 f"{self.fingerprint.vocab_size} does not have")
            if any(token >= self.fingerprint.vocab_size for token in params.heal_ids):
                raise ValueError(f"heal_ids names token ids the vocabulary of "
                                 f"{self.fingerprint.vocab_size} does not have")
            requested = Mode(hello.mode)
        except ValueError as exc:
            raise UnexpectedMessage(f"bad session parameters: {exc}") from None
        if requested is Mode.THRESHOLD and not 0.0 < hello.threshold <= 1.0:
            raise UnexpectedMessage(f"bad session parameters: threshold mode needs a threshold "
                                    f"in (0, 1], got {hello.threshold}")
        if requested is not Mode.THRESHOLD and hello.threshold:
            raise UnexpectedMessage(f"bad session parameters: a threshold applies to threshold "
                                    f"mode only, not {requested.value}")
        if self._unsupported is not None and (reason := self._unsupported(requested, params)):
            raise Unsupported(reason)
        if hello.constraint is not None:
            if self._constraint_error is None:
                raise Unsupported("this server does not take constraints")
            if reason := self._constraint_error(hello.constraint):
                raise InvalidConstraint(reason)
        # At temperature 0 every mode is greedy verification (threshold too: the target's
        # one-hot distribution passes its argmax alone), but a lossy mode keeps its label,
        # so that every report says what the edge asked for.
        self.params, self.mode = params, Mode.GREEDY if params.greedy else requested
        self.threshold, self.lossy = hello.threshold, requested.lossy
        self.state, self._checked = State.READY, True
        self.context, self._last_seq, self._last_frame, self._last_verdict = (), -1, b"", b""
        self.stream = None
        self._prompt_pending = params.prompt_logprobs is not None
        # older edges can't read it
        self.trees = self._trees and hello.protocol_version >= m.TREES_VERSION
        self.budgets = hello.protocol_version >= m.BUDGET_VERSION
        limits = self.limits
        width = limits.width if hello.protocol_version >= m.WIDTH_VERSION else 0
        return m.encode(m.Welcome(self.session_id, m.PROTOCOL_VERSION, limits.max_draft,
                                  limits.max_context, self.lossy, self.trees, width))

    def _context(self, seq: int, context_len: int, prefix: tuple[int, ...],
                 new_tokens: tuple[int, ...], extra: int) -> tuple[int, ...]:
        """Validate a request's position and tokens; return the context it builds on.
        ``extra``: positions the request adds beyond ``new_tokens``."""
        if seq <= self._last_seq:
            raise OutOfOrder(f"seq {seq} does not follow {self._last_seq}")
        if not 0 <= context_len <= len(self.context):
            raise OutOfOrder(f"request builds on {context_len} tokens of context, the server "
                             f"holds {len(self.context)}; re-send the history as prefix")
        context = self.context[:context_len] + prefix
        if not context:
            raise OutOfOrder("a request needs at least one token of context (send the prompt)")
        needed = len(context) + len(new_tokens) + extra
        if needed > self.limits.max_context:
            raise LimitExceeded(f"context of {needed} tokens is over the limit "
                                f"of {self.limits.max_context}")
        vocab = self.fingerprint.vocab_size
        if any(not 0 <= t < vocab for t in prefix + new_tokens):
            raise InvalidTokens(f"token ids must be in [0, {vocab})")
        return context

    def _draft(self, draft: m.Draft) -> VerifyRequest:
        k = len(draft.tokens)
        if k > self.limits.max_draft:
            raise LimitExceeded(f"draft of {k} tokens is over the limit of {self.limits.max_draft}")
        if draft.parents is not None and not self.trees:
            raise UnexpectedMessage("this server verifies chains only (its target's backend "
                                    "has no tree attention, or the hello was older than "
                                    "protocol 4): draft without parents")
        context = self._context(draft.seq, draft.context_len, draft.prefix, draft.tokens, 1)
        if self.mode is Mode.EXACT:
            if draft.draft_probs is None:
                raise InvalidProbabilities("exact mode needs draft_probs for every drafted token")
            for i, (token, dist) in enumerate(zip(draft.tokens, draft.draft_probs, strict=True)):
                _check_distribution(i, token, dist, self.fingerprint.vocab_size)
        self._last_seq = draft.seq
        self.context, self.stream = context, None
        return VerifyRequest(draft.seq, context, draft.tokens, draft.draft_probs, self.mode,
                             self.params, self.threshold, draft.parents, self._prompt_pending)

    def _generate(self, request: m.Generate) -> GenerateRequest:
        if request.max_tokens < 1:
            raise LimitExceeded("max_tokens must be >= 1")
        context = self._context(request.seq, request.context_len, request.prefix, (),
                                request.max_tokens)
        self._last_seq = request.seq
        self.context = context
        generate = GenerateRequest(request.seq, context, request.max_tokens,
                                   request.stop_token_ids, self.params)
        self.stream = Stream(generate, hint_start=len(context))
        return generate

    def _hint(self, hint: m.Hint) -> None:
        """Keep the drafted tokens of a hint for the generation under way: appended to the
        previous hint when they continue it and it agrees with what was generated, else as
        a new hint when they start within what the server holds; a hint for no generation,
        or past a gap, is ignored. Its alternatives are kept for the positions held, at
        most ``max_draft`` per hint and per position."""
        stream = self.stream
        if stream is None:
            return  # arrived after its generation ended
        if hint.alternatives and not self.trees:
            raise UnexpectedMessage("this server verifies chains only (its target's backend "
                                    "has no tree attention, or the hello was older than "
                                    "protocol 4): hint without alternatives")
        if len(hint.alternatives) > self.limits.max_draft:
            raise LimitExceeded(f"hint of {len(hint.alternatives)} alternatives is over the "
                                f"limit of {self.limits.max_draft}")
        vocab = self.fingerprint.vocab_size
        if any(not 0 <= t < vocab for t in (*hint.tokens, *(t for _, t in hint.alternatives))):
            raise InvalidTokens(f"token ids must be in [0, {vocab})")
        n, start = len(self.context), stream.hint_start
        if hint.position == start + len(stream.hint) and self._agrees(stream):
            tokens = stream.hint + hint.tokens
        elif 0 <= hint.position <= n:
            stream.hint_start, tokens = hint.position, hint.tokens
            stream.alternatives = {}
        else:
            return
        # Hold no more than the server could verify in one step.
        ahead = n - stream.hint_start + self.limits.max_draft
        stream.hint = tokens[:max(0, ahead)]
        stream.reach = hint.position + len(hint.tokens)
        end = stream.hint_start + len(stream.hint)
        for offset, token in hint.alternatives:
            position = hint.position + offset
            here = stream.alternatives.get(position, ())
            if (position < end and token != hint.tokens[offset] and token not in here
                    and len(here) < self.limits.max_draft):
                stream.alternatives[position] = (*here, token)

    def hint_ahead(self) -> tuple[int, ...]:
        """The hinted tokens ahead of the context, if the hint agrees with the context up
        to there; else nothing."""
        stream = self.stream
        if stream is None or not self._agrees(stream):
            return ()
        return stream.hint[len(self.context) - stream.hint_start:]

    def _agrees(self, stream: Stream) -> bool:
        """Whether ``stream``'s hint agrees with the context as far as both go."""
        n, start = len(self.context), stream.hint_start
        return start <= n and stream.hint[:n - start] == self.context[start:n]

    def _verifiable(self, ahead: tuple[int, ...]) -> tuple[int, ...]:
        """The part of the hint ahead that one step of the generation under way may verify:
        within ``max_draft``, and leaving room in ``max_tokens`` for a token of its own."""
        assert self.stream is not None, "no generation under way"
        budget = self.stream.request.max_tokens - self.stream.generated - 1
        return ahead[:max(0, min(budget, self.limits.max_draft))]

    def stream_step(self) -> VerifyRequest:
        """The next step of the generation under way: a verification of the part of the
        hint ahead of the context when the hint agrees with the context so far, else of
        an empty draft (one token of the target's own). With alternatives, a tree: each
        position's hinted token, then its alternatives, as leaves of the same parent, depth
        by depth for as long as ``max_draft`` allows."""
        stream = self.stream
        assert stream is not None, "no generation under way"
        ahead = self.hint_ahead()
        tail = self._verifiable(ahead)
        start = len(self.context)
        stream.hint_start, stream.hint = start, ahead  # spent when contradicted
        stream.alternatives = {p: alts for p, alts in stream.alternatives.items()
                               if start <= p < start + len(ahead)}  # of the hint that agrees
        mode = Mode.GREEDY if stream.request.params.greedy else Mode.MATCH
        tokens, parents, parent = list(tail), None, -1
        if any(start + depth in stream.alternatives for depth in range(len(tail))):
            tokens, parents = [], []
            for depth, token in enumerate(tail):
                here = (token, *stream.alternatives.get(start + depth, ()))
                here = here[:self.limits.max_draft - len(tokens)]
                if not here:
                    break
                tokens += here
                parents += [parent] * len(here)
                parent = len(tokens) - len(here)  # the hinted token goes on
        return VerifyRequest(stream.request.seq, self.context, tuple(tokens), None, mode,
                             stream.request.params,
                             parents=tuple(parents) if parents is not None else None,
                             prompt_logprobs=self._prompt_pending, stepped=True)

    # -- output -----------------------------------------------------------------------
    def tokens(self, request: VerifyRequest, num_accepted: int, next_token: int,
               compute_s: float, path: tuple[int, ...] | None = None,
               logprobs: Logprobs | None = None,
               prompt_logprobs: Logprobs | None = None, budget: int | None = None,
               verified: int = -1) -> StepOut:
        """Record the outcome of :meth:`stream_step`'s request (``path``: a tree's
        accepted nodes; ``logprobs``: of the tokens it emits, when the hello asked, and
        ``prompt_logprobs`` of its context; ``budget``: the positions the server expects
        to verify of the next hint, told to an edge that reads it; ``verified``: how many
        leading positions of the hint the pass verified, -1: all) and queue its ``Tokens``
        frame."""
        if request.parents is None:
            accepted, drafted = request.tokens[:num_accepted], len(request.tokens)
        else:
            assert path is not None and len(path) == num_accepted, "a tree's verdict has a path"
            accepted = tuple(request.tokens[i] for i in path)
            drafted = tree_depth(request.parents)
        if verified >= 0:
            drafted = min(drafted, verified)
        return self._emit((*accepted, next_token), compute_s, drafted, num_accepted,
                          logprobs, prompt_logprobs, budget)

    def engine_tokens(self, tokens: tuple[int, ...], compute_s: float) -> StepOut:
        """Record the tokens of one step of the generation under way, generated by an
        engine that takes the hint itself (vLLM, through its proposer): the hint's tokens
        ahead of the context that the step's tokens begin with count as accepted."""
        stream = self.stream
        assert stream is not None, "no generation under way"
        hint = self.hint_ahead()
        ahead = self._verifiable(hint)
        drafted = len(ahead)
        accepted = min(common_prefix(ahead, tokens), len(tokens) - 1)
        stream.hint_start, stream.hint = len(self.context), hint  # spent when contradicted
        return self._emit(tokens, compute_s, drafted, accepted)

    def _emit(self, emitted: tuple[int, ...], compute_s: float, drafted: int,
              accepted: int, logprobs: Logprobs | None = None,
              prompt_logprobs: Logprobs | None = None, budget: int | None = None) -> StepOut:
        stream = self.stream
        assert stream is not None, "no generation under way"
        generate = stream.request
        emitted = emitted[:generate.max_tokens - stream.generated]
        stop = next((i for i, t in enumerate(emitted) if t in generate.stop_token_ids), None)
        if stop is not None:
            emitted = emitted[:stop + 1]
        self.context += emitted
        stream.generated += len(emitted)
        done = stop is not None or stream.generated >= generate.max_tokens
        if done:
            self.stream = None
        accepted = min(accepted, len(emitted))
        if prompt_logprobs is not None:
            self._prompt_pending = False
        self._outgoing.append(m.encode(m.Tokens(
            generate.seq, emitted, done, compute_s, drafted, accepted,
            logprobs.rows(0, len(emitted)) if logprobs is not None else None, prompt_logprobs,
            self._told(budget))))
        return StepOut(done, drafted, accepted, len(emitted), compute_s)

    def verdict(self, request: VerifyRequest, num_accepted: int, next_token: int,
                verify_s: float, path: tuple[int, ...] | None = None,
                logprobs: Logprobs | None = None,
                prompt_logprobs: Logprobs | None = None, budget: int | None = None,
                verified: int = -1) -> None:
        """Record the verifier's decision for ``request`` (``path``: a tree's accepted
        nodes; ``logprobs``, ``prompt_logprobs``, ``budget`` and ``verified`` as in
        :meth:`tokens`) and queue its ``Verdict`` frame (which tells an edge that reads the
        budget how many positions were verified, where the pass cut the draft)."""
        accepted = request.tokens[:num_accepted] if path is None else tuple(
            request.tokens[i] for i in path)
        self.context = request.context + accepted + (next_token,)
        if prompt_logprobs is not None:
            self._prompt_pending = False
        told = self._told(budget)
        depth = len(request.tokens) if request.parents is None else tree_depth(request.parents)
        cut = verified if told is not None and 0 <= verified < depth else None
        self._last_verdict = m.encode(m.Verdict(request.seq, num_accepted, next_token, verify_s,
                                                path, logprobs, prompt_logprobs, told, cut))
        self._outgoing.append(self._last_verdict)


    def _told(self, budget: int | None) -> int | None:
        """``budget`` as this session's edge is told it: within ``max_draft``, and only to
        an edge that reads it."""
        if budget is None or not self.budgets:
            return None
        return min(budget, self.limits.max_draft)


def _check_distribution(i: int, token: int, dist: SparseProbs, vocab: int) -> None:
    ids, probs = dist.ids, dist.probs
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise InvalidTokens(f"draft_probs[{i}] has ids outside [0, {vocab})")
    if np.unique(ids).size != ids.size:
        raise InvalidProbabilities(f"draft_probs[{i}] repeats an id")
    if not np.all(np.isfinite(probs)) or np.any(probs < 0):
        raise InvalidProbabilities(f"draft_probs[{i}] has NaN, infinite or negative values")
    if abs(float(probs.astype(np.float64).sum()) - 1.0) > PROB_SUM_TOLERANCE:
        raise InvalidProbabilities(f"draft_probs[{i}] sums to {probs.sum():.6f}, not 1")
    if dist.prob_of(token) <= 0:
        raise InvalidProbabilities(f"drafted token {token} at {i} has zero draft probability")
