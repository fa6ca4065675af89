"""Wire messages: frozen dataclasses with a compact msgpack encoding. Sans-I/O.

A frame is one msgpack array ``[type, field, field, ...]``. Token ids travel as a msgpack
list or as raw little-endian uint16, whichever is shorter; times as integer quarters of a
millisecond; the tokenizer hash as raw bytes; an absent draft distribution as no field at
all (frames are tens of bytes, so each byte shows: see the README's bytes per token); a
draft distribution as raw little-endian arrays (uint32 ids, float32 probabilities) so
that the verifier reads exactly the numbers the drafter sampled from.

Each message class is its own codec (:class:`Codec`), as python-websockets' ``Frame``
is: its fields, its wire layout (``WIRE``: the kind of each field on the wire, in order;
``OPTIONAL``: how many trailing ones may be left off, each added after the message's first
release so that frames from older peers still decode), its encoding (``body``) and its
decoding (``from_body``); the :class:`Hello` also carries its version rules
(:meth:`Hello.lowest_version`, :meth:`Hello.check_version`) and its mapping to and from
:class:`~spececd.core.params.SamplingParams` (:meth:`Hello.from_params`,
:meth:`Hello.params`). :func:`encode` and :func:`decode` only frame them.

`decode` checks structure and types only and raises :class:`MalformedFrame`; what a value
means (a token id in range, a context length that follows) is checked by the session state
machines, which know the vocabulary and the limits.

Exchange (docs/how-it-works.md, "A request's path"; the rules in docs/protocol.md)::

    edge                                   cloud
    Hello(version, fingerprint, sampling, mode, auth, threshold, extras, constraint,
          logprobs, heal_ids)  ->
                                           <- Welcome(session_id, limits, lossy)
    Draft(seq, context_len, prefix, tokens, draft_probs, parents) ->
                                           <- Verdict(seq, num_accepted, next_token, verify_s, path,
                                                      logprobs, prompt_logprobs, budget,
                                                      verified)
    ...
    Close ->

or, for cloud-only generation, ``Generate(seq, context_len, prefix, max_tokens, stops)``
answered by a stream of ``Tokens(seq, token_ids, done, compute_s, drafted, accepted,
logprobs, prompt_logprobs, budget)``.
While such a stream runs the edge may send ``Hint(position, tokens, alternatives)`` frames
(stream drafting): drafted tokens for the positions from ``position`` on, continuing the
previous hint or replacing it, and (protocol 5, trees) other candidates for some of those
positions. A hint gets no answer of its own: before each step the server
verifies whatever part of the latest hint lies ahead of its position and agrees with what
it has generated, and the ``Tokens`` of that step say how many draft tokens it verified
(``drafted``) and kept (``accepted``). A hint that arrives too late is ignored.

A draft may be a tree of candidates (protocol 4, when the ``Welcome`` says ``trees``):
``parents[i]`` is the node drafted token ``i`` follows (``-1``: the context's last token,
each parent before its children), and the verdict's ``path`` lists the nodes it accepted,
root first. A chain sends neither.

Log-probabilities (protocol 6) travel only when the hello asks (``LogprobsAsk``): a
``Verdict`` then carries the target's log-probabilities of the tokens it emits (the
accepted drafts and its own), a ``Tokens`` frame those of its ``token_ids``, and the first
reply after a hello that asked for the prompt's (echo) those of its request's context
after the first token (:mod:`spececd.core.logprobs`), each as raw little-endian arrays.
Frames of a session that asked for none are unchanged.

The server's budget (protocol 7, to an edge whose hello says 7): under load the server
verifies only the leading positions of each draft that are worth their place in its pass,
and a ``Verdict`` or ``Tokens`` frame then says how many positions it expects to verify of
the session's next draft or hint (``budget``); left off while it verifies whatever comes.
A ``Verdict`` on a draft the pass cut then also says how many leading positions it verified
(``verified``; a ``Tokens`` frame's ``drafted`` says it), so that the edge counts none
past them as rejected. A cut chain's first token past the cut is decided from the row after
the last verified one, as an uncut verification decides it (kept: the verdict's
``next_token`` is that token), so that the block ends where the edge put it. An edge that
follows the budget drafts no positions that would be cut (except in exact mode with a
fixed ``k``: whole blocks, so that a seed fixes the tokens); one that ignores it loses
nothing but the drafting.

``Draft.context_len`` is the length of the server-side context the draft builds on; the
server first cuts its context to that length, then appends ``prefix`` (the prompt, a new
chat turn, or the whole history when resuming), then verifies ``tokens``. Any message may
be answered by ``Error(code, message, seq, fatal)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import msgpack  # type: ignore[import-untyped]
import numpy as np

from spececd.core.logprobs import Logprobs
from spececd.core.params import RAW, Constraint, SamplingParams
from spececd.core.sampling import SparseProbs
from spececd.core.verify import check_tree
from spececd.protocol.errors import MalformedFrame, VersionMismatch

PROTOCOL_VERSION = 8  # 3: the Hello's sampling extras; 4: token trees; 5: trees in hints;
# 6: the Hello's constraint (a schema, regex, choice or grammar the output must match),
# log-probabilities and token healing (heal_ids); 7: the server's budget in replies;
# 8: the Welcome's width
# The versions a server accepts. An edge sends the lowest version that carries what it
# asks for (2 without extras or trees), so mixed fleets keep working through a rolling
# upgrade of servers first (an edge asking for trees needs a server that speaks 4); only a
# version-4 hello gets the Welcome field an older edge could not read. An edge sends hints
# with alternatives only to a server whose Welcome says 5 (older ones refuse the field).
COMPATIBLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8)
TREES_VERSION = 4  # the lowest hello that offers token trees
# The lowest hello whose edge reads the budget in verdicts and tokens frames. An edge offers
# it by default and, answered version_mismatch by an older server, greets again at the
# lowest version that carries the rest of what it asks for (no budget then).
BUDGET_VERSION = 7
# The lowest hello whose edge reads the Welcome's width; offered by default too, and answered
# version_mismatch by an older server, the edge greets again at BUDGET_VERSION.
WIDTH_VERSION = 8
HINT_TREES_VERSION = 5  # the lowest welcome whose server takes alternatives in hints

# The kinds of field on the wire (WIRE of each message; :func:`_check` knows each).
_INT, _NUM, _STR, _BOOL, _IDS, _BIN = "int", "num", "str", "bool", "ids", "bin"
_NODES = "nodes"  # a list of node indices, -1 allowed
_MAYBE_NODES = "nodes?"  # the same, or None
_LOGPROBS = "logprobs"  # None or [top, chosen f4 bytes, ids u4 bytes, logprobs f4 bytes]
_EXTRAS = "extras"  # [4 numbers, prompt_len, bias ids, bias values]
_CONSTRAINT = "constraint"  # [kind, spec, strict], or None when a later field is sent
_ASK = "ask"  # [top, prompt top, mode], or None
_PROBS = "probs"  # None or [sizes, ids u4 bytes, probs f4 bytes]

TICK = 2.5e-4  # seconds per unit of time on the wire (a verify pass fits in one byte)


class Codec(Protocol):
    """What each message class is besides its fields: its own codec. ``TYPE`` is the
    first element of its frames; ``WIRE`` the kind of each field on the wire, in order;
    ``OPTIONAL`` how many trailing fields a frame may leave off."""

    TYPE: ClassVar[int]
    WIRE: ClassVar[tuple[str, ...]]
    OPTIONAL: ClassVar[int]

    def body(self) -> list[Any]:
        """The fields after the type, as ``WIRE`` lays them out (optional ones left off
        where the message holds their defaults, as its docstring says)."""

    @classmethod
    def from_body(cls, body: list[Any]) -> Any:
        """The message of a ``body`` that :func:`decode` checked against ``WIRE``; raises
        :class:`MalformedFrame` for what the kinds alone cannot check."""


@dataclass(frozen=True)
class Fingerprint:
    """Model compatibility: the vocabulary size and a hash of the tokenizer's vocabulary."""

    vocab_size: int
    tokenizer_hash: str


# In a Hello after the first on a connection: "the fingerprint this connection checked".
SAME_FINGERPRINT = Fingerprint(0, "")


@dataclass(frozen=True)
class SamplingExtras:
    """The Hello's sampling settings beyond temperature, top-k and top-p (protocol 3):
    each side applies them identically (see :mod:`spececd.core.sampling`). On the wire as
    one list, left off when every value is its default."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    prompt_len: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class LogprobsAsk:
    """The Hello's request for log-probabilities (protocol 6): ``top`` alternatives per
    generated token (-1: none asked), ``prompt_top`` per token of the prompt (echo; -1:
    none), in ``mode`` (``raw_logprobs`` or ``processed_logprobs``). Left off the wire when
    nothing is asked."""

    top: int = -1
    prompt_top: int = -1
    mode: str = RAW

    @property
    def asked(self) -> bool:
        """Whether any log-probabilities are asked for."""
        return self.top >= 0 or self.prompt_top >= 0


@dataclass(frozen=True)
class Hello:
    """The edge's greeting: which protocol it speaks, its models' fingerprint, the mode and
    the sampling settings both sides apply, its auth token.

    Wire: ``[version, vocab_size, tokenizer hash, mode, temperature, top_k, top_p, seed,
    auth_token, threshold?, extras?, constraint?, ask?, heal_ids?]``; each optional field is
    sent when it or a later one is (``None`` then stands for an absent constraint or ask).
    """

    TYPE: ClassVar[int] = 1
    WIRE: ClassVar[tuple[str, ...]] = (_INT, _INT, _BIN, _STR, _NUM, _INT, _NUM, _INT, _STR,
                                       _NUM, _EXTRAS, _CONSTRAINT, _ASK, _IDS)
    OPTIONAL: ClassVar[int] = 5
    protocol_version: int
    fingerprint: Fingerprint
    mode: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    auth_token: str = ""
    threshold: float = 0.0  # threshold mode (lossy) only; left off the wire when 0
    extras: SamplingExtras = SamplingExtras()
    # Protocol 6: what the output after the prompt must match (the verifier masks every
    # position with it); the extras then carry the prompt's length.
    constraint: Constraint | None = None
    logprobs: LogprobsAsk = LogprobsAsk()  # protocol 6
    # Protocol 6, token healing: the only tokens the first generated position (after the
    # extras' prompt_len tokens) may take; empty: any. Left off the wire when empty.
    heal_ids: tuple[int, ...] = ()

    @classmethod
    def from_params(cls, params: SamplingParams, fingerprint: Fingerprint, mode: str,
                    auth_token: str = "", threshold: float = 0.0, trees: bool = False,
                    reads: int = 0) -> Hello:
        """The hello that asks for ``params`` (whose ``seed`` must be set), speaking the
        lowest version that carries it; ``trees``: offer token trees (version 4 at least);
        ``reads``: the version whose replies the edge reads (:data:`BUDGET_VERSION`: the
        server's budget; :data:`WIDTH_VERSION`: that and the Welcome's width; 0: neither).
        ``max_tokens`` and ``stop_token_ids`` stay with the edge; the prompt's length
        travels only where the server needs it (penalties over the output, a constraint,
        token healing)."""
        if params.seed is None:
            raise ValueError("a hello needs a concrete seed")
        counts_output = bool(params.presence_penalty or params.frequency_penalty
                             or params.constraint is not None or params.heal_ids)
        extras = SamplingExtras(params.repetition_penalty, params.presence_penalty,
                                params.frequency_penalty, params.min_p,
                                params.prompt_len if counts_output else 0, params.logit_bias)
        ask = LogprobsAsk(-1 if params.logprobs is None else params.logprobs,
                          -1 if params.prompt_logprobs is None else params.prompt_logprobs,
                          params.logprobs_mode)
        hello = cls(0, fingerprint, mode, params.temperature, params.top_k, params.top_p,
                    params.seed, auth_token, threshold, extras, params.constraint, ask,
                    params.heal_ids)
        version = max(hello.lowest_version(), TREES_VERSION if trees else 0, reads)
        return cls(version, fingerprint, mode, params.temperature, params.top_k,
                   params.top_p, params.seed, auth_token, threshold, extras,
                   params.constraint, ask, params.heal_ids)

    def params(self) -> SamplingParams:
        """The sampling settings this hello asks for (raises
        :class:`~spececd.errors.InputError`, a ``ValueError``, for values out of range)."""
        extras, ask = self.extras, self.logprobs
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=self.seed, repetition_penalty=extras.repetition_penalty,
            presence_penalty=extras.presence_penalty,
            frequency_penalty=extras.frequency_penalty, min_p=extras.min_p,
            logit_bias=extras.logit_bias, prompt_len=extras.prompt_len,
            constraint=self.constraint,
            logprobs=ask.top if ask.top >= 0 else None,
            prompt_logprobs=ask.prompt_top if ask.prompt_top >= 0 else None,
            logprobs_mode=ask.mode, heal_ids=self.heal_ids)

    def lowest_version(self) -> int:
        """The lowest protocol version that carries what this hello asks for: 6 for a
        constraint, log-probabilities or token healing, 3 for sampling extras, else 2."""
        if self.constraint is not None or self.logprobs.asked or self.heal_ids:
            return 6
        return 3 if self.extras != SamplingExtras() else 2

    def check_version(self) -> None:
        """Raise :class:`~spececd.protocol.errors.VersionMismatch` unless this server
        speaks the hello's version and that version carries what the hello asks for."""
        if self.protocol_version not in COMPATIBLE_VERSIONS \
                or self.protocol_version < self.lowest_version():
            raise VersionMismatch(f"edge speaks protocol {self.protocol_version}, this server "
                                  f"speaks {PROTOCOL_VERSION}; upgrade the older side")

    def body(self) -> list[Any]:
        fp, extras, constraint, ask = (self.fingerprint, self.extras, self.constraint,
                                       self.logprobs)
        body: list[Any] = [self.protocol_version, fp.vocab_size,
                           _hash_bytes(fp.tokenizer_hash), self.mode,
                           _number(self.temperature), self.top_k, _number(self.top_p),
                           self.seed, self.auth_token]
        # Each optional field is sent when it or a later one is: None stands for absent.
        later: list[Any] = [
            None if constraint is None else [constraint.kind, constraint.spec,
                                             constraint.strict],
            [ask.top, ask.prompt_top, ask.mode] if ask.asked else None,
            _pack_ids(self.heal_ids) if self.heal_ids else None]
        while later and later[-1] is None:
            later.pop()
        if self.threshold or extras != SamplingExtras() or later:
            body.append(_number(self.threshold))
        if extras != SamplingExtras() or later:
            body.append([_number(extras.repetition_penalty), _number(extras.presence_penalty),
                         _number(extras.frequency_penalty), _number(extras.min_p),
                         extras.prompt_len, [t for t, _ in extras.logit_bias],
                         [_number(b) for _, b in extras.logit_bias]])
        body.extend(later)
        return body

    @classmethod
    def from_body(cls, body: list[Any]) -> Hello:
        fp_hash = body[2].hex() if isinstance(body[2], bytes) else body[2]
        extras = SamplingExtras()
        if len(body) > 10:
            rep, presence, frequency, min_p, prompt_len, ids, biases = body[10]
            extras = SamplingExtras(float(rep), float(presence), float(frequency),
                                    float(min_p), prompt_len,
                                    tuple(zip(ids, map(float, biases), strict=True)))
        constraint = None
        if len(body) > 11 and body[11] is not None:
            try:
                constraint = Constraint(*body[11])
            except ValueError as exc:  # an unknown kind, a malformed choice list
                raise MalformedFrame(f"constraint: {exc}") from None
        ask = LogprobsAsk(*body[12]) if len(body) > 12 and body[12] else LogprobsAsk()
        return cls(body[0], Fingerprint(body[1], fp_hash), body[3], float(body[4]), body[5],
                   float(body[6]), body[7], body[8],
                   float(body[9]) if len(body) > 9 else 0.0, extras, constraint, ask,
                   _unpack_ids(body[13]) if len(body) > 13 else ())


@dataclass(frozen=True)
class Welcome:
    """The server's answer to a hello. Wire: ``[session_id, protocol_version, max_draft,
    max_context, lossy?, trees?, width?]``."""

    TYPE: ClassVar[int] = 2
    WIRE: ClassVar[tuple[str, ...]] = (_STR, _INT, _INT, _INT, _BOOL, _BOOL, _INT)
    OPTIONAL: ClassVar[int] = 3
    session_id: str
    protocol_version: int
    max_draft: int
    max_context: int
    lossy: bool = False  # the session's mode may change the output distribution
    trees: bool = False  # the server verifies token trees (protocol 4 hellos only)
    # The longest draft the server's runner verifies in one pass (protocol 8 hellos only;
    # 0: not said): how far an edge may send drafts that cost it nothing to draft (a
    # prediction, a lookup) in one round.
    width: int = 0

    def body(self) -> list[Any]:
        body: list[Any] = [self.session_id, self.protocol_version, self.max_draft,
                           self.max_context]
        if self.lossy or self.trees or self.width:
            body.append(self.lossy)
        if self.trees or self.width:
            body.append(self.trees)
        if self.width:
            body.append(self.width)
        return body

    @property
    def pass_width(self) -> int:
        """The longest free draft one round should send: :attr:`width` within
        ``max_draft``; 0 where the server did not say (an older one, whose runner may not
        verify ``max_draft`` in one pass: then no long passes)."""
        return min(self.width, self.max_draft)

    @classmethod
    def from_body(cls, body: list[Any]) -> Welcome:
        return cls(*body)


@dataclass(frozen=True)
class Draft:
    """Drafted tokens to verify. Wire: ``[seq, context_len, prefix, tokens, draft_probs?,
    parents?]`` (``draft_probs`` ``None`` when only ``parents`` is sent)."""

    TYPE: ClassVar[int] = 3
    WIRE: ClassVar[tuple[str, ...]] = (_INT, _INT, _IDS, _IDS, _PROBS, _NODES)
    OPTIONAL: ClassVar[int] = 2
    seq: int
    context_len: int
    prefix: tuple[int, ...]
    tokens: tuple[int, ...]
    draft_probs: tuple[SparseProbs, ...] | None = None  # one per token, exact mode only
    parents: tuple[int, ...] | None = None  # a tree: each token's parent node (-1: root)

    def body(self) -> list[Any]:
        body: list[Any] = [self.seq, self.context_len, _pack_ids(self.prefix),
                           _pack_ids(self.tokens)]
        if self.draft_probs is not None or self.parents is not None:
            body.append(_pack_probs(self.draft_probs))
        if self.parents is not None:
            body.append(list(self.parents))
        return body

    @classmethod
    def from_body(cls, body: list[Any]) -> Draft:
        """The draft of a checked body (see :func:`decode`); a malformed tree or
        distribution raises :class:`MalformedFrame`."""
        tokens = _unpack_ids(body[3])
        parents = tuple(body[5]) if len(body) > 5 else None
        if parents is not None:
            try:
                check_tree(parents, len(tokens))
            except ValueError as exc:
                raise MalformedFrame(f"parents: {exc}") from None
        return cls(body[0], body[1], _unpack_ids(body[2]), tokens,
                   _unpack_probs(body[4] if len(body) > 4 else None, len(tokens)), parents)


@dataclass(frozen=True)
class Verdict:
    """The verifier's answer to a draft. Wire: ``[seq, num_accepted, next_token, verify
    ticks, path?, logprobs?, prompt_logprobs?, budget?, verified?]`` (``path`` ``None`` for
    a chain when a later field follows, the log-probabilities ``None`` when the budget
    follows; ``verified`` only with the budget)."""

    TYPE: ClassVar[int] = 4
    WIRE: ClassVar[tuple[str, ...]] = (_INT, _INT, _INT, _INT, _MAYBE_NODES, _LOGPROBS,
                                       _LOGPROBS, _INT, _INT)
    OPTIONAL: ClassVar[int] = 5
    seq: int
    num_accepted: int
    next_token: int
    verify_s: float = 0.0
    path: tuple[int, ...] | None = None  # a tree's accepted nodes, root first
    logprobs: Logprobs | None = None  # of the num_accepted + 1 tokens emitted (protocol 6)
    prompt_logprobs: Logprobs | None = None  # of the context after its first token (echo)
    # Protocol 7: positions of the next draft the server expects to verify (None: any).
    budget: int | None = None
    # Protocol 7, with the budget: the leading positions of this draft the server verified
    # when it cut the rest (None: all); the positions past it were never judged.
    verified: int | None = None

    def body(self) -> list[Any]:
        body: list[Any] = [self.seq, self.num_accepted, self.next_token,
                           _ticks(self.verify_s)]
        budgeted = self.budget is not None
        replied = self.logprobs is not None or self.prompt_logprobs is not None or budgeted
        if self.path is not None or replied:
            body.append(list(self.path) if self.path is not None else None)
        if replied:
            body += [_pack_logprobs(self.logprobs), _pack_logprobs(self.prompt_logprobs)]
        if budgeted:
            body.append(self.budget)
            if self.verified is not None:
                body.append(self.verified)
        return body

    @classmethod
    def from_body(cls, body: list[Any]) -> Verdict:
        logprobs, prompt_logprobs = _logprobs_pair(body[5:7])
        return cls(body[0], body[1], body[2], body[3] * TICK,
                   tuple(body[4]) if len(body) > 4 and body[4] is not None else None,
                   logprobs, prompt_logprobs, _budget(body, 7), _budget(body, 8))


@dataclass(frozen=True)
class Generate:
    """Cloud-only generation: the server extends the context itself, token by token, and
    streams each as a ``Tokens`` frame (the baseline the drafter has to beat). Wire:
    ``[seq, context_len, prefix, max_tokens, stop_token_ids]``."""

    TYPE: ClassVar[int] = 7
    WIRE: ClassVar[tuple[str, ...]] = (_INT, _INT, _IDS, _INT, _IDS)
    OPTIONAL: ClassVar[int] = 0
    seq: int
    context_len: int
    prefix: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()

    def body(self) -> list[Any]:
        return [self.seq, self.context_len, _pack_ids(self.prefix), self.max_tokens,
                list(self.stop_token_ids)]

    @classmethod
    def from_body(cls, body: list[Any]) -> Generate:
        return cls(body[0], body[1], _unpack_ids(body[2]), body[3], tuple(body[4]))


@dataclass(frozen=True)
class Tokens:
    """One step of a cloud-only generation. Wire: ``[seq, token_ids, done, compute ticks,
    drafted?, accepted?, logprobs?, prompt_logprobs?, budget?]`` (the counts go together,
    as do the log-probabilities, ``None`` when the budget follows)."""

    TYPE: ClassVar[int] = 8
    WIRE: ClassVar[tuple[str, ...]] = (_INT, _IDS, _BOOL, _INT, _INT, _INT, _LOGPROBS,
                                       _LOGPROBS, _INT)
    OPTIONAL: ClassVar[int] = 5
    seq: int
    token_ids: tuple[int, ...]
    done: bool
    compute_s: float = 0.0
    drafted: int = 0  # draft tokens this step verified (from the edge's hints)
    accepted: int = 0  # of those, kept: the first ``accepted`` of ``token_ids``
    logprobs: Logprobs | None = None  # of token_ids (protocol 6)
    prompt_logprobs: Logprobs | None = None  # of the context after its first token (echo)
    # Protocol 7: positions of the next hint the server expects to verify (None: any).
    budget: int | None = None

    def body(self) -> list[Any]:
        body: list[Any] = [self.seq, _pack_ids(self.token_ids), self.done,
                           _ticks(self.compute_s)]
        budgeted = self.budget is not None
        replied = self.logprobs is not None or self.prompt_logprobs is not None or budgeted
        if self.drafted or self.accepted or replied:
            body += [self.drafted, self.accepted]
        if replied:
            body += [_pack_logprobs(self.logprobs), _pack_logprobs(self.prompt_logprobs)]
        if budgeted:
            body.append(self.budget)
        return body

    @classmethod
    def from_body(cls, body: list[Any]) -> Tokens:
        logprobs, prompt_logprobs = _logprobs_pair(body[6:8])
        drafted, accepted = (body[4], body[5]) if len(body) > 5 else (0, 0)
        return cls(body[0], _unpack_ids(body[1]), body[2], body[3] * TICK, drafted, accepted,
                   logprobs, prompt_logprobs, _budget(body, 8))


@dataclass(frozen=True)
class Hint:
    """Drafted tokens for a cloud-only generation under way, from ``position`` on, and
    (protocol 5, to a server whose ``Welcome`` says ``trees``) ``alternatives``: pairs
    ``(offset, token)``, each a candidate for position ``position + offset`` in place of
    ``tokens[offset]``, which nothing of the hint follows (a small tree: leaf siblings of
    the hint's chain). Wire: ``[position, tokens, alternatives flattened?]``."""

    TYPE: ClassVar[int] = 9
    WIRE: ClassVar[tuple[str, ...]] = (_INT, _IDS, _NODES)
    OPTIONAL: ClassVar[int] = 1
    position: int
    tokens: tuple[int, ...]
    alternatives: tuple[tuple[int, int], ...] = ()

    def body(self) -> list[Any]:
        body: list[Any] = [self.position, _pack_ids(self.tokens)]
        if self.alternatives:
            body.append([v for pair in self.alternatives for v in pair])
        return body

    @classmethod
    def from_body(cls, body: list[Any]) -> Hint:
        """The hint of a checked body (see :func:`decode`); alternatives that are not
        pairs on the hint's own positions raise :class:`MalformedFrame`."""
        tokens = _unpack_ids(body[1])
        flat = body[2] if len(body) > 2 else []
        pairs = tuple(zip(flat[::2], flat[1::2], strict=True)) if len(flat) % 2 == 0 else None
        if pairs is None or any(not 0 <= offset < len(tokens) for offset, _ in pairs):
            raise MalformedFrame("hint alternatives must be (offset, token) pairs, each offset "
                                 "one of the hint's tokens")
        return cls(body[0], tokens, pairs)


@dataclass(frozen=True)
class Close:
    """The end of a session. Wire: ``[reason]``."""

    TYPE: ClassVar[int] = 5
    WIRE: ClassVar[tuple[str, ...]] = (_STR,)
    OPTIONAL: ClassVar[int] = 0
    reason: str = ""

    def body(self) -> list[Any]:
        return [self.reason]

    @classmethod
    def from_body(cls, body: list[Any]) -> Close:
        return cls(*body)


@dataclass(frozen=True)
class Error:
    """A typed error (:mod:`spececd.protocol.errors`). Wire: ``[code, message, seq,
    fatal]``."""

    TYPE: ClassVar[int] = 6
    WIRE: ClassVar[tuple[str, ...]] = (_STR, _STR, _INT, _BOOL)
    OPTIONAL: ClassVar[int] = 0
    code: str
    message: str
    seq: int = -1
    fatal: bool = False

    def body(self) -> list[Any]:
        return [self.code, self.message, self.seq, self.fatal]

    @classmethod
    def from_body(cls, body: list[Any]) -> Error:
        return cls(*body)


Message = Hello | Welcome | Draft | Verdict | Generate | Tokens | Hint | Close | Error
_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Draft, Verdict, Generate, Tokens, Hint, Close,
                              Error)}


def encode(message: Message) -> bytes:
    """One frame: the msgpack array ``[type, *message.body()]``."""
    return msgpack.packb([message.TYPE, *message.body()],  # type: ignore[no-any-return]
                         use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Parse one frame; raise :class:`MalformedFrame` if it is not a well-formed message."""
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedFrame(f"frame is not valid msgpack: {exc}") from None
    if not isinstance(raw, list) or not raw or not _check(_INT, raw[0]):
        raise MalformedFrame("frame must be a msgpack array starting with a message type")
    kind, body = raw[0], raw[1:]
    cls = _TYPES.get(kind)
    if cls is None:
        raise MalformedFrame(f"unknown message type {kind}")
    if not len(cls.WIRE) - cls.OPTIONAL <= len(body) <= len(cls.WIRE) \
            or not all(map(_check, cls.WIRE, body)):
        raise MalformedFrame(f"message type {kind} has missing or mistyped fields")
    return cls.from_body(body)


def _logprobs_pair(values: list[Any]) -> tuple[Logprobs | None, Logprobs | None]:
    """A reply's log-probabilities of its tokens and of the prompt, each None where left
    off."""
    emitted, prompt = (*values, None, None)[:2]
    return _unpack_logprobs(emitted), _unpack_logprobs(prompt)


def _budget(body: list[Any], index: int) -> int | None:
    """A reply's budget, at ``index`` of its ``body`` (None: left off)."""
    if len(body) <= index:
        return None
    if body[index] < 0:
        raise MalformedFrame(f"a budget of {body[index]} positions")
    return int(body[index])


def _pack_probs(dists: tuple[SparseProbs, ...] | None) -> list[Any] | None:
    if dists is None:
        return None
    sizes = [int(d.ids.size) for d in dists]
    ids = np.concatenate([d.ids for d in dists] or [np.zeros(0)]).astype("<u4").tobytes()
    probs = np.concatenate([d.probs for d in dists] or [np.zeros(0)]).astype("<f4").tobytes()
    return [sizes, ids, probs]


def _unpack_probs(value: list[Any] | None, k: int) -> tuple[SparseProbs, ...] | None:
    if value is None:
        return None
    sizes, id_bytes, prob_bytes = value
    total = sum(sizes)
    if len(sizes) != k or min(sizes, default=1) < 1 or len(id_bytes) != 4 * total \
            or len(prob_bytes) != 4 * total:
        raise MalformedFrame("draft_probs: sizes do not match the drafted tokens or the data")
    ids = np.frombuffer(id_bytes, dtype="<u4").astype(np.int64)
    probs = np.frombuffer(prob_bytes, dtype="<f4").astype(np.float32)
    bounds = np.cumsum([0, *sizes])
    return tuple(SparseProbs(ids=ids[a:b], probs=probs[a:b])
                 for a, b in itertools.pairwise(bounds))


def _pack_logprobs(logprobs: Logprobs | None) -> list[Any] | None:
    if logprobs is None:
        return None
    return [logprobs.top, logprobs.chosen.astype("<f4").tobytes(),
            logprobs.top_ids.astype("<u4").tobytes(),
            logprobs.top_logprobs.astype("<f4").tobytes()]


def _unpack_logprobs(value: list[Any] | None) -> Logprobs | None:
    if value is None:
        return None
    top, chosen, ids, values = value
    n = len(chosen) // 4
    if top < 0 or len(chosen) % 4 or len(ids) != 4 * n * top or len(values) != 4 * n * top:
        raise MalformedFrame("logprobs: the arrays' sizes do not match")
    return Logprobs(np.frombuffer(chosen, dtype="<f4").astype(np.float32),
                    np.frombuffer(ids, dtype="<u4").astype(np.int64).reshape(n, top),
                    np.frombuffer(values, dtype="<f4").astype(np.float32).reshape(n, top))


def _pack_ids(ids: tuple[int, ...]) -> list[int] | bytes:
    """Token ids as whichever is shorter: a msgpack list (1 byte per id under 128, 3 under
    65,536) or raw little-endian uint16 (2 bytes per id, 2 bytes of header)."""
    listed = sum(1 if t < 128 else 3 if t < 65536 else 5 for t in ids)
    if len(ids) > 1 and all(0 <= t < 65536 for t in ids) and 2 * len(ids) + 2 < listed:
        return np.asarray(ids, dtype="<u2").tobytes()
    return list(ids)


def _unpack_ids(value: list[int] | bytes) -> tuple[int, ...]:
    if isinstance(value, bytes):
        return tuple(int(t) for t in np.frombuffer(value, dtype="<u2"))
    return tuple(value)


def _ticks(seconds: float) -> int:
    return max(0, round(seconds / TICK))


def _number(value: float) -> float | int:
    """A whole number (temperature 0, top-p 1) as a 1-byte integer instead of a double."""
    return int(value) if float(value).is_integer() else value


def _hash_bytes(tokenizer_hash: str) -> bytes | str:
    """The tokenizer hash as raw bytes when it is hex (it always is from this package)."""
    try:
        return bytes.fromhex(tokenizer_hash)
    except ValueError:
        return tokenizer_hash


def _check(kind: str, value: Any) -> bool:
    """Whether ``value`` is a well-formed field of wire kind ``kind``."""
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _BIN:
        return isinstance(value, (bytes, str))
    if kind == _MAYBE_NODES:
        return value is None or _check(_NODES, value)
    if kind == _LOGPROBS:
        return value is None or (
            isinstance(value, list) and len(value) == 4 and _check(_INT, value[0])
            and all(isinstance(v, bytes) for v in value[1:]))
    if kind == _ASK:
        return value is None or (isinstance(value, list) and len(value) == 3
                                 and _check(_INT, value[0]) and _check(_INT, value[1])
                                 and _check(_STR, value[2]))
    if kind == _NODES:
        return isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)
    if kind == _IDS:
        return (isinstance(value, bytes) and len(value) % 2 == 0) or (
            isinstance(value, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value))
    if kind == _CONSTRAINT:
        return value is None or (isinstance(value, list) and len(value) == 3
                                 and _check(_STR, value[0]) and _check(_STR, value[1])
                                 and _check(_BOOL, value[2]))
    if kind == _EXTRAS:
        return (isinstance(value, list) and len(value) == 7
                and all(_check(_NUM, v) for v in value[:4]) and _check(_INT, value[4])
                and isinstance(value[5], list) and _check(_IDS, value[5])
                and isinstance(value[6], list) and len(value[6]) == len(value[5])
                and all(_check(_NUM, v) for v in value[6]))
    assert kind == _PROBS, kind
    return value is None or (
        isinstance(value, list) and len(value) == 3 and isinstance(value[0], list)
        and _check(_IDS, value[0])
        and isinstance(value[1], bytes) and isinstance(value[2], bytes))


__all__ = [
    "COMPATIBLE_VERSIONS",
    "PROTOCOL_VERSION",
    "SAME_FINGERPRINT",
    "Close",
    "Draft",
    "Error",
    "Fingerprint",
    "Generate",
    "Hello",
    "Hint",
    "LogprobsAsk",
    "Message",
    "SamplingExtras",
    "Tokens",
    "Verdict",
    "Welcome",
    "decode",
    "encode",
]
