"""Log-probabilities on the wire (protocol 6), socket-free: the hello's request, the
verdict's and tokens' arrays, exactly round-tripped; frames of sessions that ask for none
unchanged; the prompt's asked for once per hello; the edge refusing replies that lack
what it asked for."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from spececd.core.logprobs import Logprobs
from spececd.core.params import Constraint, Mode, SamplingParams
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import CloudSession, VerifyRequest
from spececd.protocol.edge_session import EdgeSession
from spececd.protocol.errors import MalformedFrame, UnexpectedMessage
from tests.support.protocol import FP, LIMITS, error_of, receive, sent
from tests.support.protocol import session_hello as hello


def rows(n: int, top: int, seed: int = 0) -> Logprobs:
    rng = np.random.default_rng(seed)
    return Logprobs(-rng.random(n).astype(np.float32), rng.integers(0, 100, (n, top)),
                    -rng.random((n, top)).astype(np.float32))


def same(a: Logprobs | None, b: Logprobs | None) -> bool:
    assert a is not None and b is not None
    return bool(np.array_equal(a.chosen, b.chosen) and np.array_equal(a.top_ids, b.top_ids)
                and np.array_equal(a.top_logprobs, b.top_logprobs))


@pytest.mark.parametrize("constraint,ask,heal", [
    (Constraint("regex", "[ab]+"), m.LogprobsAsk(2), (4, 9)),
    (None, m.LogprobsAsk(2), ()),  # the constraint's place is sent as nil
    (None, m.LogprobsAsk(), (7,)),  # ... and the ask's
    (Constraint("choice", '["yes", "no"]'), m.LogprobsAsk(), ())])
def test_a_hellos_version_6_fields_travel_together_or_alone(
        constraint: Constraint | None, ask: m.LogprobsAsk, heal: tuple[int, ...]) -> None:
    greeting = m.Hello(6, FP, "match", 0.7, 0, 1.0, 3, constraint=constraint, logprobs=ask,
                       heal_ids=heal)
    assert m.decode(m.encode(greeting)) == greeting


def test_logprobs_round_trip_exactly_in_verdicts_and_tokens() -> None:
    ask = m.LogprobsAsk(5, 2, "processed_logprobs")
    greeting = m.Hello(6, FP, "match", 0.7, 0, 1.0, 3, "", 0.0, m.SamplingExtras(), logprobs=ask)
    assert m.decode(m.encode(greeting)) == greeting
    for verdict in (m.Verdict(3, 2, 77, 0.01, None, rows(3, 5), rows(9, 2, 1)),
                    m.Verdict(3, 1, 77, 0.01, (0, 2), rows(2, 0), None)):
        decoded = m.decode(m.encode(verdict))
        assert isinstance(decoded, m.Verdict) and decoded.path == verdict.path
        assert same(decoded.logprobs, verdict.logprobs)
        assert (decoded.prompt_logprobs is None) == (verdict.prompt_logprobs is None)
    tokens = m.Tokens(4, (1, 2), True, 0.002, 0, 0, rows(2, 20), rows(4, 20, 2))
    decoded = m.decode(m.encode(tokens))
    assert isinstance(decoded, m.Tokens) and decoded.token_ids == (1, 2) and decoded.done
    assert same(decoded.logprobs, tokens.logprobs)
    assert same(decoded.prompt_logprobs, tokens.prompt_logprobs)
    # Frames that carry none are as before: no field added.
    assert len(msgpack.unpackb(m.encode(m.Verdict(3, 1, 77, 0.01)))) == 5
    assert len(msgpack.unpackb(m.encode(m.Tokens(4, (1,), False, 0.0)))) == 5
    assert len(msgpack.unpackb(m.encode(m.Hello(5, FP, "match", 0.7, 0, 1.0, 3)))) == 10


@pytest.mark.parametrize("frame", [
    msgpack.packb([4, 1, 0, 5, 0, None, [2, b"\x00" * 8, b"\x00" * 15, b"\x00" * 16], None]),
    msgpack.packb([4, 1, 0, 5, 0, None, [1, b"\x00" * 6, b"", b""], None]),  # not float32s
    msgpack.packb([4, 1, 0, 5, 0, None, [1, b""], None]),  # arrays missing
    msgpack.packb([8, 1, [1], True, 0, 0, 0, "logprobs", None]),
    msgpack.packb([1, 6, 5, "h", "exact", 1.0, 0, 1.0, 1, "", 0, [1, 0, 0, 0, 0, [], []],
                   [5, "x", "raw_logprobs"]]),  # prompt top as a string
])
def test_malformed_logprobs_raise(frame: bytes) -> None:
    with pytest.raises(MalformedFrame):
        m.decode(frame)


def test_an_older_hello_cannot_ask_and_a_bad_ask_is_refused() -> None:
    for version, ask in ((5, m.LogprobsAsk(1)), (6, m.LogprobsAsk(21)),
                         (6, m.LogprobsAsk(0, -1, "raw_logits"))):
        session = CloudSession(FP, LIMITS)
        reply = error_of(receive(session, hello(protocol_version=version, logprobs=ask)))
        assert reply.code in ("version_mismatch", "unexpected_message"), reply


def test_the_prompts_logprobs_are_asked_for_once_per_hello() -> None:
    session = CloudSession(FP, LIMITS)
    welcome = receive(session, hello(logprobs=m.LogprobsAsk(2, 3), mode="match"))
    assert isinstance(welcome, bytes) and isinstance(m.decode(welcome), m.Welcome)
    assert session.params.logprobs == 2 and session.params.prompt_logprobs == 3
    first = receive(session, m.encode(m.Draft(1, 0, (5, 6, 7), (8,))))
    assert isinstance(first, VerifyRequest) and first.prompt_logprobs
    session.verdict(first, 1, 9, 0.01, None, rows(2, 2), rows(2, 3))
    verdict = m.decode(sent(session))
    assert isinstance(verdict, m.Verdict) and verdict.prompt_logprobs is not None
    second = receive(session, m.encode(m.Draft(2, 5, (), (4,))))
    assert isinstance(second, VerifyRequest) and not second.prompt_logprobs
    # A session that asks for none: no request computes them, no frame carries them.
    plain = CloudSession(FP, LIMITS)
    receive(plain, hello(mode="match"))
    request = receive(plain, m.encode(m.Draft(1, 0, (5, 6, 7), (8,))))
    assert isinstance(request, VerifyRequest) and not request.prompt_logprobs
    assert request.params.logprobs is None


def test_the_edge_asks_with_protocol_6_and_checks_what_comes_back() -> None:
    params = SamplingParams(temperature=0, seed=1, logprobs=3, prompt_logprobs=0)
    edge = EdgeSession(FP, Mode.GREEDY, params, budget=False)
    greeting = m.decode(edge.hello())
    assert isinstance(greeting, m.Hello) and greeting.protocol_version == 6
    assert greeting.logprobs == m.LogprobsAsk(3, 0)
    assert m.decode(EdgeSession(FP, Mode.GREEDY, SamplingParams(seed=1), budget=False).hello()) \
        .protocol_version == 2  # type: ignore[union-attr]
    edge.receive(m.encode(m.Welcome("s", 6, 4, 64)))
    edge.draft([1, 2, 3], (4, 5), None)
    with pytest.raises(UnexpectedMessage):  # two tokens emitted, one row
        edge.receive(m.encode(m.Verdict(1, 1, 9, 0.0, None, rows(1, 3), rows(2, 0))))
    edge.draft([1, 2, 3], (4, 5), None)
    with pytest.raises(UnexpectedMessage):  # asked for, not sent
        edge.receive(m.encode(m.Verdict(2, 1, 9)))
    edge.draft([1, 2, 3], (4, 5), None)
    reply = edge.receive(m.encode(m.Verdict(3, 1, 9, 0.0, None, rows(2, 3), rows(2, 0))))
    assert isinstance(reply, m.Verdict) and not edge.prompt_pending
    # Once received, a later hello (a reconnect) does not ask for the prompt's again.
    again = m.decode(edge.hello())
    assert isinstance(again, m.Hello) and again.logprobs == m.LogprobsAsk(3, -1)
