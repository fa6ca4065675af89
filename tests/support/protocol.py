"""The protocol's test frames and a cloud session fed by them, with no socket: one
:func:`hello` for every test that greets a server by hand, and the helpers of the
session tests (:mod:`tests.protocol`)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from spececd.backends.base import Backend, tokenizer_fingerprint
from spececd.core.sampling import SparseProbs
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import CloudSession, Limits

FP = m.Fingerprint(100, "f" * 64)  # the session tests' models: 100 tokens
LIMITS = Limits(max_draft=4, max_context=32, max_message_bytes=4096)


def hello(model: Backend | m.Fingerprint, mode: str = "match", temperature: float = 0.0,
          **fields: Any) -> bytes:
    """A ``Hello`` frame for ``model`` (a backend, whose fingerprint it takes, or a
    fingerprint) in ``mode`` at ``temperature``, speaking :data:`~m.PROTOCOL_VERSION`
    with top-k 0, top-p 1 and seed 7, unless ``fields`` (any of the Hello's) say otherwise."""
    fingerprint = model if isinstance(model, m.Fingerprint) else tokenizer_fingerprint(
        model.tokenizer, model.vocab_size)
    settings: dict[str, Any] = dict(protocol_version=m.PROTOCOL_VERSION, fingerprint=fingerprint,
                                    mode=mode, temperature=temperature, top_k=0, top_p=1.0,
                                    seed=7)
    return m.encode(m.Hello(**(settings | fields)))


# The session tests' greeting: exact mode at temperature 1 with seed 5, for FP's models.
session_hello = functools.partial(hello, FP, mode="exact", temperature=1.0, seed=5)


def receive(session: CloudSession, frame: bytes) -> object:
    """Feed one frame; what came of it: the request to run, the frame to send, or None
    (a hint or a close). A frame never gives more than one of them."""
    session.receive_data(frame)
    out = [*session.events_received(), *session.data_to_send()]
    assert len(out) <= 1, out
    return out[0] if out else None


def sent(session: CloudSession) -> bytes:
    """The one frame the session queued to send since the last look."""
    frames = session.data_to_send()
    assert len(frames) == 1, frames
    return frames[0]


def error_of(reply: object) -> m.Error:
    """The ``Error`` a reply frame holds (it must hold one)."""
    assert isinstance(reply, bytes)
    message = m.decode(reply)
    assert isinstance(message, m.Error), message
    return message


def q(token: int) -> SparseProbs:
    """A draft distribution that gave ``token`` three quarters of its mass."""
    return SparseProbs(np.array([token, 50]), np.array([0.75, 0.25], np.float32))
