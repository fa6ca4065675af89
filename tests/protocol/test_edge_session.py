"""The edge's session state machine, driven by frames alone: the hello it sends for its
settings, the errors it raises, the paths it checks, and a whole exchange with a
:class:`~spececd.protocol.cloud_session.CloudSession`. No sockets, no models."""

from __future__ import annotations

import dataclasses

import pytest

from spececd.core.params import Mode, SamplingParams
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import CloudSession, Limits, VerifyRequest
from spececd.protocol.edge_session import EdgeSession
from spececd.protocol.errors import AuthFailed, IncompatibleModels, OutOfOrder, UnexpectedMessage
from tests.support.protocol import FP, LIMITS, q, receive, sent


def test_the_edge_greets_with_its_threshold() -> None:
    edge = EdgeSession(FP, Mode.THRESHOLD, SamplingParams(seed=1), threshold=0.2)
    session = CloudSession(FP, LIMITS)
    welcome = edge.receive(receive(session, edge.hello()))  # type: ignore[arg-type]
    assert isinstance(welcome, m.Welcome) and welcome.lossy and session.threshold == 0.2


def test_edge_and_cloud_sessions_talk_and_resume() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    edge = EdgeSession(FP, Mode.MATCH, params)
    cloud = CloudSession(FP, LIMITS)
    edge.receive(receive(cloud, edge.hello()))  # type: ignore[arg-type]
    history = [1, 2, 3]
    request = receive(cloud, edge.draft(history, (4, 5), None))
    assert isinstance(request, VerifyRequest) and request.context == (1, 2, 3)
    cloud.verdict(request, 1, 8, 0.0)
    verdict = edge.receive(sent(cloud))
    assert isinstance(verdict, m.Verdict)
    history += [4, 8]
    assert edge.server_len == 5
    # Only the new draft travels; the server already holds the history.
    frame = edge.draft(history, (9,), None)
    decoded = m.decode(frame)
    assert isinstance(decoded, m.Draft) and decoded.prefix == () and decoded.context_len == 5
    # A new server (restart): after hello the whole history travels again.
    cloud = CloudSession(FP, LIMITS)
    edge.receive(receive(cloud, edge.hello()))  # type: ignore[arg-type]
    request = receive(cloud, edge.draft(history, (9,), None))
    assert isinstance(request, VerifyRequest) and request.context == tuple(history)


def test_edge_raises_the_typed_error_it_receives() -> None:
    edge = EdgeSession(FP, Mode.EXACT, SamplingParams(seed=1))
    with pytest.raises(IncompatibleModels):
        edge.receive(m.encode(m.Error("incompatible_models", "no", -1, True)))
    with pytest.raises(AuthFailed):
        edge.receive(m.encode(m.Error("auth_failed", "no", -1, True)))
    with pytest.raises(UnexpectedMessage):
        edge.receive(m.encode(m.Verdict(1, 0, 1, 0.0)))  # no draft pending
    with pytest.raises(OutOfOrder):
        edge.receive(m.encode(m.Error("out_of_order", "no", 1, False)))


def test_a_hello_without_extras_speaks_protocol_2_for_servers_not_yet_upgraded() -> None:
    plain = EdgeSession(FP, Mode.MATCH, SamplingParams(seed=1, prompt_len=5))
    penalized = EdgeSession(FP, Mode.MATCH, SamplingParams(seed=1, prompt_len=5,
                                                           presence_penalty=0.5))
    # Each offers the width (8) first, then the budget (7); a server that refuses both gets
    # the lowest version.
    for edge in (plain, penalized):
        assert edge.hello_message.protocol_version == m.WIDTH_VERSION
        assert edge.older_server() and edge.hello_message.protocol_version == m.BUDGET_VERSION
        assert edge.older_server() and not edge.older_server()
    assert plain.hello_message.protocol_version == 2
    assert plain.hello_message.extras == m.SamplingExtras()  # prompt_len matters to no one
    assert penalized.hello_message.protocol_version == 3
    assert penalized.hello_message.extras.prompt_len == 5
    for edge in (plain, penalized):  # this server takes both
        session = CloudSession(FP, Limits())
        assert isinstance(m.decode(receive(session, edge.hello())), m.Welcome)
    forged = m.encode(dataclasses.replace(penalized.hello_message, protocol_version=2))
    error = m.decode(receive(CloudSession(FP, Limits()), forged))
    assert isinstance(error, m.Error) and error.code == "version_mismatch"


def test_the_edge_checks_the_verdicts_path_against_its_tree() -> None:
    edge = EdgeSession(FP, Mode.EXACT, SamplingParams(seed=5), trees=True, budget=False)
    assert edge.hello_message.protocol_version == 4
    edge.receive(m.encode(m.Welcome("s", 4, 4, 32, False, True)))
    assert edge.trees
    for path, ok in (((1, 2), True), ((0, 2), False), ((2,), False), (None, False)):
        edge.draft([1, 2, 3], (4, 6, 5), tuple(q(t) for t in (4, 6, 5)), (-1, -1, 1))
        frame = m.encode(m.Verdict(edge._seq, len(path or ()), 9, 0.0, path))
        if ok:
            assert edge.receive(frame).path == path  # type: ignore[union-attr]
        else:
            with pytest.raises(UnexpectedMessage, match="path"):
                edge.receive(frame)
