"""The verifier service: target model, sessions, and one verification per draft.

:class:`VerifierService` owns the loaded target and the limits; each connection gets a
:class:`Connection` that feeds frames through a :class:`CloudSession` state machine and
runs the verification it asks for: one target forward pass over the tokens the cache
lacks plus the drafted block, then :func:`spececd.core.verify.verify`. The target's KV
cache is rolled back lazily, at the start of the next round, to what the verdict kept.

Transports (in-memory, WebSocket, ...) only move frames to and from a Connection.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence

import numpy as np

from spececd.backends.base import Backend, CachedSequence, sync, tokenizer_fingerprint
from spececd.cloud.metrics import Metrics
from spececd.core.sampling import VERIFIER_STREAM, process_logits, round_rng
from spececd.core.verify import VerifyResult, verify
from spececd.protocol.session import (
    CloudSession,
    GenerateRequest,
    Limits,
    State,
    VerifyRequest,
)

log = logging.getLogger(__name__)


def run_verifications(backend: Backend, work: Sequence[tuple[CachedSequence, VerifyRequest]]
                      ) -> list[VerifyResult]:
    """Verify each request's tokens after its context on its own cached sequence, all in
    one target forward pass when the backend can batch (``extend_batch``)."""
    items = []
    for sequence, request in work:
        feed = sync(sequence, request.context)
        items.append((sequence, [*feed, *request.tokens], len(request.tokens) + 1))
    batch = getattr(backend, "extend_batch", None)
    if batch is not None and len(items) > 1:
        all_logits = batch(items)
    else:
        all_logits = [sequence.extend(ids, keep) for sequence, ids, keep in items]
    results = []
    for (_, request), logits in zip(work, all_logits, strict=True):  # logits: [k + 1, vocab]
        target_probs = process_logits(logits, request.params)
        assert request.params.seed is not None
        rngs = functools.partial(_position_rng, request.params.seed, len(request.context))
        results.append(verify(request.tokens, target_probs, rngs, request.mode,
                              request.draft_probs))
    return results


def _position_rng(seed: int, start: int, offset: int) -> np.random.Generator:
    return round_rng(seed, VERIFIER_STREAM, start + offset)


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
        self.busy = False  # a verification of this session is queued or running
        self.last_used = time.monotonic()
        self._reported: dict[str, int] = {}  # errors already counted in the metrics

    @property
    def closed(self) -> bool:
        return self.session.state is State.CLOSED

    def accept(self, frame: bytes) -> bytes | VerifyRequest | GenerateRequest | None:
        """Run one frame through the session: the reply to send, the work to run, or None
        (the session closed). Cheap: no model work."""
        errors = sum(self.session.errors.values())
        out = self.session.receive(frame)
        if sum(self.session.errors.values()) > errors:
            for code, n in self.session.errors.items():
                if n > self._reported.get(code, 0):
                    self.service.metrics.errors.labels(code).inc(n - self._reported.get(code, 0))
                    self._reported[code] = n
                    log.warning("rejected a frame: %s", code, extra={
                        "session": self.session.session_id, "request": self.session.request_seq,
                        "code": code})
        if out is None:
            self.close()
        elif not isinstance(out, bytes):
            if self.sequence is None:
                self.sequence = self.service.backend.new_sequence()
            log.debug("request", extra={"session": self.session.session_id,
                                        "request": out.seq, "context": len(out.context)})
        return out

    def verdict(self, request: VerifyRequest, result: VerifyResult, seconds: float) -> bytes:
        self.service.metrics.record_verdict(len(request.tokens), result.num_accepted, seconds)
        return self.session.verdict(request, result.num_accepted, result.next_token, seconds)

    def generated(self, request: VerifyRequest, result: VerifyResult,
                  seconds: float) -> tuple[bytes, bool]:
        """The frame for one step of a cloud-only generation (``request`` from
        ``session.stream_step()``), and whether it is the last."""
        before = len(self.session.context)
        frame, done = self.session.tokens(request, result.num_accepted, result.next_token,
                                          seconds)
        self.service.metrics.generated_tokens.inc(len(self.session.context) - before)
        if request.tokens:
            self.service.metrics.record_verdict(len(request.tokens), result.num_accepted,
                                                seconds)
        return frame, done

    def receive(self, frame: bytes) -> Iterator[bytes]:
        """Handle one frame from the edge here and now (no batching); yield the frames to send
        back (several for a cloud-only generation, which streams one frame per step)."""
        out = self.accept(frame)
        if out is None:
            return
        if isinstance(out, bytes):
            if out:
                yield out
            return
        assert self.sequence is not None
        backend = self.service.backend
        passes = self.service.metrics.batch_size  # every pass here verifies this session alone
        if isinstance(out, VerifyRequest):
            t0 = time.perf_counter()
            (result,) = run_verifications(backend, [(self.sequence, out)])
            passes.observe(1)
            yield self.verdict(out, result, time.perf_counter() - t0)
            return
        while self.session.stream is not None:
            t0 = time.perf_counter()
            step = self.session.stream_step()
            (result,) = run_verifications(backend, [(self.sequence, step)])
            passes.observe(1)
            yield self.generated(step, result, time.perf_counter() - t0)[0]

    @property
    def kv_tokens(self) -> int:
        return len(self.sequence.tokens) if self.sequence is not None else 0

    def close(self) -> None:
        self.session.state = State.CLOSED
        self.sequence = None  # frees the KV cache
