"""The constraint on the wire (protocol 6): the hello carries it and the prompt's length,
older versions cannot, the server refuses one it cannot compile with a typed fatal error
and one it does not take as unsupported; and through the service, a refused hello leaves
the server serving others."""

from __future__ import annotations

import pytest

from spececd.core.params import Constraint, Mode, SamplingParams
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import CloudSession, Limits
from spececd.protocol.edge_session import EdgeSession
from spececd.protocol.errors import InvalidConstraint, error_for_code
from tests.support.protocol import FP, LIMITS, error_of, receive
from tests.support.protocol import session_hello as hello

SCHEMA = Constraint("json_schema", '{"type": "object"}', strict=False)


def test_the_hello_carries_the_constraint_and_the_prompts_length() -> None:
    params = SamplingParams(seed=1, prompt_len=7, constraint=SCHEMA)
    message = m.decode(EdgeSession(FP, Mode.MATCH, params, budget=False).hello())
    assert isinstance(message, m.Hello)
    assert (message.protocol_version, message.constraint) == (6, SCHEMA)
    assert message.extras.prompt_len == 7
    plain = m.decode(EdgeSession(FP, Mode.MATCH, SamplingParams(seed=1, prompt_len=7),
                                 budget=False).hello())
    assert isinstance(plain, m.Hello) and plain.protocol_version == 2  # older servers serve it
    assert plain.constraint is None


@pytest.mark.parametrize("version", [2, 3, 4, 5])
def test_an_older_version_cannot_carry_a_constraint(version: int) -> None:
    session = CloudSession(FP, LIMITS, constraint_error=lambda c: "")
    reply = error_of(receive(session, hello(protocol_version=version, constraint=SCHEMA)))
    assert reply.code == "version_mismatch" and reply.fatal


def test_an_unknown_kind_on_the_wire_is_a_malformed_frame() -> None:
    frame = bytearray(hello(constraint=Constraint("regex", "a+")))
    frame = frame.replace(b"regex", b"rogex")
    reply = error_of(receive(CloudSession(FP, LIMITS), bytes(frame)))
    assert reply.code == "malformed_frame" and "constraint kind" in reply.message


def test_the_server_checks_the_constraint_and_names_what_is_wrong() -> None:
    seen: list[Constraint] = []

    def compile_error(constraint: Constraint) -> str:
        seen.append(constraint)
        return "invalid regex constraint: unbalanced" if constraint.kind == "regex" else ""

    session = CloudSession(FP, LIMITS, constraint_error=compile_error)
    welcome = receive(session, hello(constraint=SCHEMA))
    assert isinstance(welcome, bytes) and isinstance(m.decode(welcome), m.Welcome)
    assert session.params.constraint == SCHEMA and seen == [SCHEMA]
    refused = error_of(receive(CloudSession(FP, LIMITS, constraint_error=compile_error),
                               hello(constraint=Constraint("regex", "(a"))))
    assert (refused.code, refused.fatal) == ("invalid_constraint", True)
    assert isinstance(error_for_code(refused.code, refused.message), InvalidConstraint)
    assert "unbalanced" in refused.message
    unsupported = error_of(receive(CloudSession(FP, LIMITS), hello(constraint=SCHEMA)))
    assert unsupported.code == "unsupported"


def test_the_service_refuses_a_bad_constraint_and_serves_others() -> None:
    pytest.importorskip("xgrammar")
    from spececd.backends.base import tokenizer_fingerprint
    from spececd.transports.memory import local_verifier
    from tests.toy import toy_pair

    _, target = toy_pair()
    server = local_verifier(target, Limits())
    fp = tokenizer_fingerprint(target.tokenizer, target.vocab_size)
    try:
        bad = server()
        bad.send(m.encode(m.Hello(6, fp, "match", 0.0, 0, 1.0, 1, extras=m.SamplingExtras(
            prompt_len=1), constraint=Constraint("grammar", "root ::= nothing"))))
        reply = m.decode(bad.recv())
        assert isinstance(reply, m.Error) and reply.code == "invalid_constraint"
        assert 'Rule "nothing" is not defined' in reply.message
        good = server()
        params = SamplingParams(temperature=0.0, seed=1, prompt_len=1,
                                constraint=Constraint.of_choices(["ab", "ba"]))
        edge = EdgeSession(fp, Mode.GREEDY, params)
        good.send(edge.hello())
        assert isinstance(edge.receive(good.recv()), m.Welcome)
        good.send(edge.draft([120], (ord("q"),), None))  # a token the constraint refuses
        verdict = edge.receive(good.recv())
        assert isinstance(verdict, m.Verdict) and verdict.num_accepted == 0
        assert verdict.next_token in (ord("a"), ord("b"))
    finally:
        server.close()
