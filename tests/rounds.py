"""Speculative rounds without a transport: a draft source and the real verification pass
(:func:`~spececd.cloud.scheduler.run_verifications`) on a backend, for the statistical
tests that draw thousands of generations."""

from __future__ import annotations

from collections.abc import Sequence

from spececd.backends.base import Backend
from spececd.cloud.scheduler import run_verifications
from spececd.core.params import Mode, SamplingParams
from spececd.edge.drafter import DraftSource
from spececd.grammar import ConstraintMatcher
from spececd.protocol.cloud_session import VerifyRequest
from tests.toy import EOS


def generate(drafter: DraftSource, target: Backend, matcher: ConstraintMatcher | None,
             prompt: Sequence[int], params: SamplingParams, mode: Mode, k: int) -> list[int]:
    """One generation: rounds of ``k`` drafted tokens verified by the target's pass (its
    rows masked by ``matcher``; None: not masked), until the end-of-sequence token or
    ``params.max_tokens``."""
    sequence, history = target.new_sequence(), list(prompt)
    assert params.seed is not None
    while len(history) - len(prompt) < params.max_tokens:
        k_now = min(k, params.max_tokens - (len(history) - len(prompt)) - 1)
        tokens, dists = drafter.draft(history, k_now, mode, params, params.seed, 8)
        request = VerifyRequest(0, tuple(history), tokens, dists if mode is Mode.EXACT else None,
                                mode, params)
        result = run_verifications(target, [(sequence, request)], [matcher]).results[0]
        emitted = [*tokens[:result.num_accepted], result.next_token]
        for token in emitted:
            history.append(token)
            if token == EOS:
                return history[len(prompt):]
    return history[len(prompt):]
