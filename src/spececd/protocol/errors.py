"""The wire's error hierarchy.

Every problem the verifier finds with what an edge sent is a :class:`ProtocolError`
subclass with a stable ``code``. The server answers it with an ``Error`` message carrying
that code and a readable message, and keeps serving; the edge turns a received ``Error``
back into the same class (:func:`error_for_code`). ``fatal`` errors end the session
(the server closes it); the others reject one message and leave the session usable.

    ProtocolError
    ├── MalformedFrame        not a decodable message, or fields of the wrong type
    ├── UnexpectedMessage     a valid message in the wrong state (e.g. a draft before hello)
    ├── VersionMismatch       protocol versions differ                          (fatal)
    ├── IncompatibleModels    tokenizer fingerprints or vocabularies differ      (fatal)
    ├── AuthFailed            missing or wrong bearer token                      (fatal)
    ├── Unsupported           the server's engine cannot serve the hello's mode or
    │                         sampling settings (the message says which)         (fatal)
    ├── InvalidConstraint     the hello's constraint (schema, regex, choice, grammar) cannot
    │                         be compiled; the message says which and why (protocol 6) (fatal)
    ├── InvalidTokens         a token id outside the vocabulary
    ├── InvalidProbabilities  NaN, negative, non-normalised or inconsistent draft_probs
    ├── LimitExceeded         over a configured limit (draft length, context, message size)
    ├── OutOfOrder            a sequence number or context length that does not follow
    ├── UnknownSession        a session or link id the server does not hold (never had, or
    │                         closed or idled out): open a new one and re-send the history
    ├── ServerBusy            no capacity for another session                    (fatal)
    ├── Draining              the server is shutting down: reconnect (through the
    │                         balancer, to another replica) and re-send the history (fatal)
    ├── EngineFailed          the server's engine (what runs the target) has failed; the
    │                         message names the cause. The server exits for its supervisor
    │                         to restart it: the edge stops instead of retrying     (fatal)
    └── VerificationFailed    the server could not run the target pass; the session stays
                              usable (a new draft builds on what the server held before)
"""

from __future__ import annotations

from spececd.errors import SpecECDError


class ProtocolError(SpecECDError):
    code = "protocol_error"
    fatal = False


class MalformedFrame(ProtocolError):
    code = "malformed_frame"


class UnexpectedMessage(ProtocolError):
    code = "unexpected_message"


class VersionMismatch(ProtocolError):
    code = "version_mismatch"
    fatal = True


class IncompatibleModels(ProtocolError):
    code = "incompatible_models"
    fatal = True


class AuthFailed(ProtocolError):
    code = "auth_failed"
    fatal = True


class Unsupported(ProtocolError):
    code = "unsupported"
    fatal = True


class InvalidConstraint(ProtocolError):
    code = "invalid_constraint"
    fatal = True


class InvalidTokens(ProtocolError):
    code = "invalid_tokens"


class InvalidProbabilities(ProtocolError):
    code = "invalid_probabilities"


class LimitExceeded(ProtocolError):
    code = "limit_exceeded"


class OutOfOrder(ProtocolError):
    code = "out_of_order"


class UnknownSession(ProtocolError):
    code = "unknown_session"


class ServerBusy(ProtocolError):
    code = "server_busy"
    fatal = True


class Draining(ProtocolError):
    code = "draining"
    fatal = True


class EngineFailed(ProtocolError):
    code = "engine_failed"
    fatal = True


class VerificationFailed(ProtocolError):
    code = "verification_failed"


_BY_CODE: dict[str, type[ProtocolError]] = {
    cls.code: cls
    for cls in (ProtocolError, MalformedFrame, UnexpectedMessage, VersionMismatch,
                IncompatibleModels, AuthFailed, Unsupported, InvalidConstraint, InvalidTokens,
                InvalidProbabilities, LimitExceeded, OutOfOrder, UnknownSession, ServerBusy,
                Draining, EngineFailed, VerificationFailed)
}


def error_for_code(code: str, message: str) -> ProtocolError:
    """The exception an edge raises for an ``Error`` message it received."""
    return _BY_CODE.get(code, ProtocolError)(message)
