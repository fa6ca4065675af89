"""The verifier service: target model, sessions, and one verification per draft.

:class:`VerifierService` owns the loaded target and the limits; each connection gets a
:class:`Connection` that feeds frames through a :class:`CloudSession` state machine and
runs the verification it asks for: one target forward pass over the tokens the cache
lacks plus the drafted block, then :func:`spececd.core.verify.verify`. The target's KV
cache is rolled back lazily, at the start of the next round, to what the verdict kept.

Transports (in-memory, WebSocket, ...) only move frames to and from a Connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from spececd.backends.base import Backend, CachedSequence, sync, tokenizer_fingerprint
from spececd.cloud.metrics import Metrics
from spececd.core.sampling import VERIFIER_STREAM, process_logits, round_rng, sample
from spececd.core.verify import VerifyResult, verify
from spececd.protocol.session import (
    CloudSession,
    GenerateRequest,
    Limits,
    State,
    VerifyRequest,
)

log = logging.getLogger(__name__)


def run_verification(sequence: CachedSequence, request: VerifyRequest) -> VerifyResult:
    """Verify ``request.tokens`` after ``request.context`` on the target's cached sequence."""
    k = len(request.tokens)
    feed = sync(sequence, request.context)
    logits = sequence.extend([*feed, *request.tokens], keep=k + 1)  # [k + 1, vocab]
    target_probs = process_logits(logits, request.params)
    assert request.params.seed is not None
    rng = round_rng(request.params.seed, VERIFIER_STREAM, len(request.context))
    return verify(request.tokens, target_probs, rng, request.mode, request.draft_probs)


class VerifierService:
    def __init__(self, backend: Backend, limits: Limits | None = None,
                 auth_token: str = "") -> None:
        limits = limits or Limits()
        self.backend = backend
        self.limits = Limits(max_draft=limits.max_draft,
                             max_context=min(limits.max_context, backend.max_context),
                             max_message_bytes=limits.max_message_bytes)
        self.fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
        self.auth_token = auth_token
        self.metrics = Metrics()

    def connect(self) -> Connection:
        return Connection(self)


class Connection:
    """One client connection: a session state machine and, once used, a KV cache."""

    def __init__(self, service: VerifierService) -> None:
        self.service = service
        self.session = CloudSession(service.fingerprint, service.limits, service.auth_token)
        self.sequence: CachedSequence | None = None
        self._reported: dict[str, int] = {}  # errors already counted in the metrics

    @property
    def closed(self) -> bool:
        return self.session.state is State.CLOSED

    def receive(self, frame: bytes) -> Iterator[bytes]:
        """Handle one frame from the edge; yield the frames to send back (several for a
        cloud-only generation, which streams one frame per token)."""
        errors = sum(self.session.errors.values())
        out = self.session.receive(frame)
        if sum(self.session.errors.values()) > errors:
            for code, n in self.session.errors.items():
                self._reported[code] = self._reported.get(code, 0)
                if n > self._reported[code]:
                    self.service.metrics.errors.labels(code).inc(n - self._reported[code])
                    self._reported[code] = n
                    log.warning("rejected a frame: %s", code, extra={
                        "session": self.session.session_id, "code": code})
        if out is None:
            self.close()
            return
        if isinstance(out, bytes):
            yield out
            return
        if self.sequence is None:
            self.sequence = self.service.backend.new_sequence()
        if isinstance(out, GenerateRequest):
            yield from self._generate(self.sequence, out)
            return
        t0 = time.perf_counter()
        result = run_verification(self.sequence, out)
        verify_s = time.perf_counter() - t0
        self.service.metrics.record_verdict(len(out.tokens), result.num_accepted, verify_s)
        yield self.session.verdict(out, result.num_accepted, result.next_token, verify_s)

    def _generate(self, sequence: CachedSequence, request: GenerateRequest) -> Iterator[bytes]:
        """Autoregressive generation on the target alone, one frame per token."""
        assert request.params.seed is not None
        feed = sync(sequence, request.context)
        position = len(request.context)
        for i in range(request.max_tokens):
            t0 = time.perf_counter()
            logits = sequence.extend(feed, keep=1)  # [1, vocab]
            probs = process_logits(logits, request.params)[0]
            token = sample(probs, round_rng(request.params.seed, VERIFIER_STREAM, position + i))
            done = i + 1 == request.max_tokens or token in request.stop_token_ids
            self.service.metrics.generated_tokens.inc()
            yield self.session.tokens(request, (token,), done, time.perf_counter() - t0)
            if done:
                return
            feed = [token]

    @property
    def kv_tokens(self) -> int:
        return len(self.sequence.tokens) if self.sequence is not None else 0

    def close(self) -> None:
        self.session.state = State.CLOSED
        self.sequence = None  # frees the KV cache
