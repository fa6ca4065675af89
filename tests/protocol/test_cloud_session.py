"""The cloud's session state machine, driven by frames alone: no sockets, no models (the
edge's is tests/protocol/test_edge_session.py)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from spececd.core.params import Mode, SamplingParams
from spececd.core.sampling import SparseProbs
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import CloudSession, State, VerifyRequest
from spececd.protocol.edge_session import EdgeSession
from tests.support.protocol import FP, LIMITS, error_of, q, receive, sent
from tests.support.protocol import session_hello as hello


def ready(**kw: object) -> CloudSession:
    session = CloudSession(FP, LIMITS, **kw)  # type: ignore[arg-type]
    reply = receive(session, hello(auth_token=kw.get("auth_token", "")))
    assert isinstance(reply, bytes) and isinstance(m.decode(reply), m.Welcome)
    return session


def draft(seq: int, context_len: int, prefix: tuple[int, ...], tokens: tuple[int, ...],
          probs: object = "auto") -> bytes:
    dists = tuple(q(t) for t in tokens) if probs == "auto" else probs
    return m.encode(m.Draft(seq, context_len, prefix, tokens, dists))  # type: ignore[arg-type]


def test_hello_then_draft_gives_a_verify_request_and_a_verdict() -> None:
    session = ready()
    request = receive(session, draft(1, 0, (1, 2, 3), (4, 5)))
    assert isinstance(request, VerifyRequest)
    assert request.context == (1, 2, 3) and request.tokens == (4, 5)
    assert request.mode is Mode.EXACT and request.params.seed == 5
    session.verdict(request, 1, 9, 0.01)
    verdict = m.decode(sent(session))
    assert verdict == m.Verdict(1, 1, 9, 0.01)
    assert session.context == (1, 2, 3, 4, 9)


@pytest.mark.parametrize("frame,code,fatal", [
    (hello(protocol_version=m.PROTOCOL_VERSION + 1), "version_mismatch", True),
    (hello(fingerprint=m.Fingerprint(100, "0" * 64)), "incompatible_models", True),
    (hello(fingerprint=m.Fingerprint(101, "f" * 64)), "incompatible_models", True),
    (hello(mode="fast"), "unexpected_message", False),
    (hello(temperature=-1.0), "unexpected_message", False),
    (draft(1, 0, (1,), (2,)), "unexpected_message", False),
    (b"\x93garbage", "malformed_frame", False),
    (b"x" * 5000, "limit_exceeded", False),
])
def test_bad_handshakes_get_typed_errors(frame: bytes, code: str, fatal: bool) -> None:
    session = CloudSession(FP, LIMITS)
    error = error_of(receive(session, frame))
    assert (error.code, error.fatal) == (code, fatal)
    assert (session.state is State.CLOSED) == fatal


@pytest.mark.parametrize("mode,threshold,temperature,lossy", [
    ("threshold", 0.3, 1.0, True), ("threshold", 1.0, 0.0, True), ("exact", 0.0, 1.0, False),
    ("match", 0.0, 1.0, False)])
def test_the_welcome_says_whether_the_mode_is_lossy(mode: str, threshold: float,
                                                    temperature: float, lossy: bool) -> None:
    session = CloudSession(FP, LIMITS)
    welcome = m.decode(receive(session, hello(mode=mode, threshold=threshold,  # type: ignore[arg-type]
                                             temperature=temperature)))
    assert isinstance(welcome, m.Welcome) and welcome.lossy is lossy and session.lossy is lossy
    request = receive(session, draft(1, 0, (1,), (2,)))
    assert isinstance(request, VerifyRequest) and request.threshold == threshold
    # At temperature 0 the target is one-hot: threshold verification is greedy's.
    assert request.mode is (Mode(mode) if temperature else Mode.GREEDY)


@pytest.mark.parametrize("mode,threshold", [
    ("threshold", 0.0), ("threshold", 1.5), ("threshold", -0.1), ("threshold", float("nan")),
    ("match", 0.5)])
def test_a_bad_threshold_is_refused_and_changes_nothing(mode: str, threshold: float) -> None:
    session = ready()
    error = error_of(receive(session, hello(mode=mode, threshold=threshold)))
    assert error.code == "unexpected_message" and "threshold" in error.message
    assert (session.mode, session.threshold, session.lossy) == (Mode.EXACT, 0.0, False)


def test_auth_token_is_required_and_checked() -> None:
    session = CloudSession(FP, LIMITS, auth_token="s3cret")
    assert error_of(receive(session, hello())).code == "auth_failed"
    session = CloudSession(FP, LIMITS, auth_token="s3cret")
    assert error_of(receive(session, hello(auth_token="wrong"))).code == "auth_failed"
    assert isinstance(ready(auth_token="s3cret"), CloudSession)


@pytest.mark.parametrize("frame,code", [
    (draft(1, 0, (), (4,)), "out_of_order"),  # no context at all
    (draft(1, 5, (1,), (4,)), "out_of_order"),  # builds on context the server lacks
    (draft(1, 0, (1,), (1, 2, 3, 4, 5)), "limit_exceeded"),  # k over max_draft
    (draft(1, 0, tuple(range(30)), (1, 2)), "limit_exceeded"),  # context over max_context
    (draft(1, 0, (1, 100), (2,)), "invalid_tokens"),
    (draft(1, 0, (1,), (-1,), None), "invalid_tokens"),
    (draft(1, 0, (1,), (2,), None), "invalid_probabilities"),  # exact mode needs them
    (draft(1, 0, (1,), (2,), (SparseProbs(np.array([2]), np.array([np.nan], np.float32)),)),
     "invalid_probabilities"),
    (draft(1, 0, (1,), (2,), (SparseProbs(np.array([2, 3]), np.array([1.5, -0.5], np.float32)),)),
     "invalid_probabilities"),
    (draft(1, 0, (1,), (2,), (SparseProbs(np.array([2, 3]), np.array([0.5, 0.2], np.float32)),)),
     "invalid_probabilities"),
    (draft(1, 0, (1,), (2,), (SparseProbs(np.array([3]), np.array([1.0], np.float32)),)),
     "invalid_probabilities"),  # drafted token outside its own support
    (draft(1, 0, (1,), (2,), (SparseProbs(np.array([2, 2]), np.array([0.5, 0.5], np.float32)),)),
     "invalid_probabilities"),
    (draft(1, 0, (1,), (2,), (SparseProbs(np.array([2, 500]), np.array([0.5, 0.5], np.float32)),)),
     "invalid_tokens"),
    (msgpack.packb([4, 1, 0, 5, 0]), "unexpected_message"),  # a verdict from the edge
])
def test_bad_drafts_are_rejected_and_the_session_survives(frame: bytes, code: str) -> None:
    session = ready()
    error = error_of(receive(session, frame))
    assert error.code == code and not error.fatal
    assert isinstance(receive(session, draft(7, 0, (1, 2), (3,))), VerifyRequest)


def test_retransmitted_draft_gets_the_same_verdict_without_reverifying() -> None:
    session = ready()
    frame = draft(1, 0, (1, 2), (3, 4))
    request = receive(session, frame)
    assert isinstance(request, VerifyRequest)
    session.verdict(request, 2, 6, 0.0)
    verdict = sent(session)
    assert receive(session, frame) == verdict
    assert session.context == (1, 2, 3, 4, 6)


def test_sequence_numbers_must_increase() -> None:
    session = ready()
    request = receive(session, draft(5, 0, (1,), (2,)))
    assert isinstance(request, VerifyRequest)
    session.verdict(request, 0, 3, 0.0)
    assert isinstance(m.decode(sent(session)), m.Verdict)
    assert error_of(receive(session, draft(4, 2, (), (3,)))).code == "out_of_order"


def test_a_new_hello_starts_a_new_generation_on_the_connection() -> None:
    session = ready()
    request = receive(session, draft(1, 0, (1, 2), (3,)))
    assert isinstance(request, VerifyRequest)
    session.verdict(request, 1, 4, 0.0)
    assert isinstance(m.decode(sent(session)), m.Verdict)
    reply = receive(session, hello(seed=9, mode="match"))
    assert isinstance(reply, bytes) and isinstance(m.decode(reply), m.Welcome)
    assert session.context == () and session.params.seed == 9 and session.mode is Mode.MATCH
    request = receive(session, draft(1, 0, (1, 2, 3, 4), (5,), None))  # seq starts again
    assert isinstance(request, VerifyRequest) and request.context == (1, 2, 3, 4)


def test_close_ends_the_session() -> None:
    session = ready()
    assert receive(session, m.encode(m.Close())) is None
    assert session.state is State.CLOSED
    assert error_of(receive(session, draft(1, 0, (1,), (2,)))).code == "unexpected_message"


# -- stream drafting: hints for a cloud-only generation --------------------------------


def streaming(max_tokens: int = 10, stops: tuple[int, ...] = ()) -> CloudSession:
    session = CloudSession(FP, LIMITS)
    receive(session, hello(temperature=0.0))
    request = receive(session, m.encode(m.Generate(1, 0, (1, 2, 3), max_tokens, stops)))
    assert request is not None and not isinstance(request, bytes)
    return session


def step(session: CloudSession, accepted: int, token: int) -> m.Tokens:
    request = session.stream_step()
    done, *_ = session.tokens(request, accepted, token, 0.001)
    frame = sent(session)
    message = m.decode(frame)
    assert isinstance(message, m.Tokens) and message.done == done
    return message


def test_a_hint_is_verified_from_the_position_the_server_has_reached() -> None:
    session = streaming()
    assert session.stream_step().tokens == ()  # no hint yet: one token of its own
    assert step(session, 0, 7).token_ids == (7,)
    # A hint drafted before the edge saw token 7: its first token is checked against what
    # was generated, the rest is verified.
    assert receive(session, m.encode(m.Hint(3, (7, 8, 9)))) is None
    assert session.stream_step().tokens == (8, 9)
    tokens = step(session, 2, 10)
    assert (tokens.token_ids, tokens.drafted, tokens.accepted) == ((8, 9, 10), 2, 2)
    receive(session, m.encode(m.Hint(7, (11, 12))))
    receive(session, m.encode(m.Hint(9, (13,))))  # continues the previous hint
    assert session.stream_step().tokens == (11, 12, 13)


def test_a_hint_the_target_contradicted_or_that_comes_too_late_is_dropped() -> None:
    session = streaming()
    receive(session, m.encode(m.Hint(3, (5, 6))))
    step(session, 0, 4)  # verified 5, 6 and rejected 5: the target said 4
    assert session.stream_step().tokens == ()
    receive(session, m.encode(m.Hint(9, (1,))))  # past a gap: ignored
    assert session.stream_step().tokens == ()
    receive(session, m.encode(m.Hint(4, (6,) * 20)))  # more than one step can verify
    assert session.stream_step().tokens == (6,) * LIMITS.max_draft
    errors = receive(session, m.encode(m.Hint(4, (FP.vocab_size,))))
    assert error_of(errors).code == "invalid_tokens"


def test_stream_steps_respect_the_budget_and_stop_tokens() -> None:
    session = streaming(max_tokens=4, stops=(9,))
    receive(session, m.encode(m.Hint(3, (5, 6, 7, 8, 9))))
    assert session.stream_step().tokens == (5, 6, 7)  # 3 drafts + 1 of its own = the budget
    session = streaming(max_tokens=10, stops=(6,))
    receive(session, m.encode(m.Hint(3, (5, 6, 7))))
    tokens = step(session, 3, 8)
    assert tokens.token_ids == (5, 6) and tokens.done and session.stream is None
    assert receive(session, m.encode(m.Hint(5, (1,)))) is None  # after the end: ignored


def test_a_later_hello_on_the_connection_may_leave_the_fingerprint_out() -> None:
    session = CloudSession(FP, LIMITS)
    first = receive(session, hello(fingerprint=m.SAME_FINGERPRINT))
    assert error_of(first).code == "incompatible_models"  # the first must carry it
    session = ready()
    reply = receive(session, hello(fingerprint=m.SAME_FINGERPRINT, seed=9))
    assert isinstance(reply, bytes) and isinstance(m.decode(reply), m.Welcome)
    edge = EdgeSession(FP, Mode.EXACT, SamplingParams(seed=1))
    assert len(edge.hello(checked=True)) < len(edge.hello()) - 30


# -- token trees ------------------------------------------------------------------------


def tree_draft(seq: int, parents: tuple[int, ...], tokens: tuple[int, ...] = (4, 6, 5)
               ) -> bytes:
    return m.encode(m.Draft(seq, 0, (1, 2, 3), tokens, tuple(q(t) for t in tokens), parents))


def test_a_tree_round_trips_and_the_verdict_names_its_path() -> None:
    session = CloudSession(FP, LIMITS, trees=True)
    welcome = m.decode(receive(session, hello()))
    assert isinstance(welcome, m.Welcome) and welcome.trees
    request = receive(session, tree_draft(1, (-1, -1, 1)))
    assert isinstance(request, VerifyRequest) and request.parents == (-1, -1, 1)
    session.verdict(request, 2, 9, 0.01, (1, 2))
    verdict = m.decode(sent(session))
    assert verdict == m.Verdict(1, 2, 9, 0.01, (1, 2))
    assert session.context == (1, 2, 3, 6, 5, 9)  # the path's tokens, then the target's


@pytest.mark.parametrize("version,fields", [(7, 6), (8, 7)])
def test_the_pass_width_goes_to_protocol_8_edges_only(version: int, fields: int) -> None:
    """An older edge's Welcome has no field it could not read (its decoder refuses a
    seventh); a protocol-8 edge is told the width, within ``max_draft``."""
    session = CloudSession(FP, LIMITS, trees=True)
    body = msgpack.unpackb(receive(session, hello(protocol_version=version)))
    assert len(body) - 1 == fields
    welcome = m.decode(msgpack.packb(body))
    assert isinstance(welcome, m.Welcome)
    assert welcome.width == (LIMITS.max_draft if version >= m.WIDTH_VERSION else 0)


def test_trees_are_offered_to_protocol_4_edges_only_and_refused_unoffered() -> None:
    older = CloudSession(FP, LIMITS, trees=True)
    welcome = m.decode(receive(older, hello(protocol_version=3)))
    assert isinstance(welcome, m.Welcome) and not welcome.trees
    assert error_of(receive(older, tree_draft(1, (-1, -1, 1)))).code == "unexpected_message"
    chains_only = ready()  # a target without tree attention
    error = error_of(receive(chains_only, tree_draft(1, (-1, -1, 1))))
    assert error.code == "unexpected_message" and "chains only" in error.message
    assert isinstance(receive(chains_only, draft(2, 0, (1, 2, 3), (4,))), VerifyRequest)


@pytest.mark.parametrize("parents", [(-1, 0), (-1, 2, 0), (-2, -1, 0), (0, -1, 1)])
def test_a_malformed_tree_is_a_malformed_frame(parents: tuple[int, ...]) -> None:
    session = CloudSession(FP, LIMITS, trees=True)
    receive(session, hello())
    assert error_of(receive(session, tree_draft(1, parents))).code == "malformed_frame"


def test_a_hint_may_carry_a_small_tree_that_a_step_verifies_depth_by_depth() -> None:
    session = CloudSession(FP, LIMITS, trees=True)  # max_draft 4
    receive(session, hello(temperature=0.0))
    receive(session, m.encode(m.Generate(1, 0, (1, 2, 3), 10, ())))
    # Other candidates for the 1st and 3rd tokens (a duplicate of the hinted token and a
    # repeat are no nodes), then, continuing the hint, one for the 4th.
    receive(session, m.encode(m.Hint(3, (5, 6, 7), ((0, 8), (0, 5), (2, 9), (2, 9)))))
    receive(session, m.encode(m.Hint(6, (4,), ((0, 11),))))
    request = session.stream_step()
    # Depth by depth, the hinted token then its alternatives, within max_draft nodes.
    assert (request.tokens, request.parents) == ((5, 8, 6, 7), (-1, -1, 0, 2))
    # The target's token at the 1st position is 8, an alternative: it is kept, and what the
    # hint drafted after 5 is spent.
    session.tokens(request, 1, 12, 0.001, (1,))
    frame = sent(session)
    tokens = m.decode(frame)
    assert isinstance(tokens, m.Tokens)
    assert (tokens.token_ids, tokens.drafted, tokens.accepted) == ((8, 12), 3, 1)
    assert session.context == (1, 2, 3, 8, 12) and session.stream_step().tokens == ()
    # A new hint from there: alternatives of the contradicted one are gone.
    receive(session, m.encode(m.Hint(5, (4, 4))))
    assert session.stream_step().parents is None


def test_a_hint_after_a_contradicted_one_starts_afresh() -> None:
    session = streaming()
    receive(session, m.encode(m.Hint(3, (5, 6))))
    step(session, 1, 4)  # kept 5, then the target said 4 where the hint said 6
    # The edge's new hint starts where the old one ended: it is a hint of its own, not a
    # continuation of the contradicted one.
    receive(session, m.encode(m.Hint(5, (7, 8))))
    assert session.stream_step().tokens == (7, 8)


def test_hint_alternatives_are_refused_where_trees_are_not_and_checked_on_the_wire() -> None:
    session = streaming()  # a target without tree attention
    error = error_of(receive(session, m.encode(m.Hint(3, (5,), ((0, 8),)))))
    assert error.code == "unexpected_message" and "chains only" in error.message
    trees = CloudSession(FP, LIMITS, trees=True)
    receive(trees, hello(temperature=0.0))
    receive(trees, m.encode(m.Generate(1, 0, (1, 2, 3), 10, ())))
    error = error_of(receive(trees, m.encode(m.Hint(3, (5,), ((0, FP.vocab_size),)))))
    assert error.code == "invalid_tokens"
    many = tuple((0, t) for t in range(10, 10 + LIMITS.max_draft + 1))
    assert error_of(receive(trees, m.encode(m.Hint(3, (5,), many)))).code == "limit_exceeded"
    for flat in ([0], [1, 8], [-1, 8]):  # not pairs; offsets outside the hint
        frame = msgpack.packb([m.Hint.TYPE, 3, [5], flat])
        assert error_of(receive(trees, frame)).code == "malformed_frame"
    # An edge sends alternatives to a protocol-5 server that takes trees only.
    for version, trees_on, offered in ((5, True, ((0, 8),)), (4, True, ()), (5, False, ())):
        edge = EdgeSession(FP, Mode.MATCH, SamplingParams(seed=5), trees=True)
        edge.receive(m.encode(m.Welcome("s", version, 4, 32, False, trees_on)))
        assert m.decode(edge.hint(3, (5,), ((0, 8),))) == m.Hint(3, (5,), offered)


def test_an_engine_that_drafts_from_the_hint_itself_reports_what_it_kept() -> None:
    """vLLM's engine proposes the hint inside its own step: the server is told the step's
    tokens, and counts the hint's tokens they begin with as accepted."""
    session = streaming(max_tokens=10)
    receive(session, m.encode(m.Hint(3, (5, 6, 7))))
    out = session.engine_tokens((5, 6, 4), 0.001)  # kept 5 and 6, then its own 4
    tokens = m.decode(sent(session))
    assert isinstance(tokens, m.Tokens)
    assert (tokens.token_ids, tokens.drafted, tokens.accepted) == ((5, 6, 4), 3, 2)
    assert (out.drafted, out.accepted, out.emitted, out.done) == (3, 2, 3, False)
    assert session.context == (1, 2, 3, 5, 6, 4) and session.stream_step().tokens == ()
    out = session.engine_tokens((9,), 0.001)  # no hint ahead: one token of its own
    assert (out.drafted, out.accepted, out.emitted) == (0, 0, 1)
    receive(session, m.encode(m.Hint(7, (1, 2))))
    out = session.engine_tokens((1,), 0.001)  # a hint the step did not use: none kept
    assert (out.drafted, out.accepted) == (2, 0)


def test_a_mode_or_setting_the_engine_cannot_serve_is_refused_at_the_hello() -> None:
    def unsupported(mode: Mode, params: SamplingParams) -> str:
        return "no threshold here" if mode is Mode.THRESHOLD else ""

    session = CloudSession(FP, LIMITS, unsupported=unsupported)
    error = error_of(receive(session, hello(mode="threshold", threshold=0.5)))
    assert (error.code, error.fatal, error.message) == ("unsupported", True, "no threshold here")
    assert session.state is State.CLOSED
    ready(unsupported=unsupported)  # exact mode is served: welcomed


def test_a_verdict_on_a_cut_draft_says_how_many_positions_were_verified() -> None:
    """Under the budget the server may verify a leading part of a draft: the verdict then
    says how many positions it verified (with the budget only), so that the edge does not
    count the cut ones as rejected; a draft verified whole leaves it off."""
    session = ready()
    assert session.budgets
    request = receive(session, draft(1, 0, (1, 2, 3), (4, 5, 6)))
    assert isinstance(request, VerifyRequest)
    session.verdict(request, 1, 9, 0.01, budget=2, verified=2)
    assert m.decode(sent(session)) == m.Verdict(1, 1, 9, 0.01, budget=2, verified=2)
    request = receive(session, draft(2, 5, (), (7, 8)))
    assert isinstance(request, VerifyRequest)
    session.verdict(request, 2, 9, 0.01, budget=2, verified=2)
    verdict = m.decode(sent(session))
    assert isinstance(verdict, m.Verdict) and verdict.verified is None
    frame = m.Verdict(3, 0, 1, 0.0, budget=4, verified=0)
    assert m.decode(m.encode(frame)) == frame
