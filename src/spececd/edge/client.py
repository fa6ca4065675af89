"""The edge's generation loop: draft, send, apply the verdict, emit, repeat.

The edge holds the authoritative token history. Each round it drafts ``k`` tokens, sends
them through an :class:`~spececd.protocol.session.EdgeSession` over any transport, and
appends the verdict's accepted tokens plus the verifier's own token to the history. Stop
tokens and ``max_tokens`` are applied here, exactly (:func:`clip_emitted`), and ``k`` is
cut so that no round drafts past the token budget.

The loop does not know whether the verifier is in this process or across the world.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from spececd.core.sampling import Mode, SamplingParams
from spececd.core.stats import GenerationStats
from spececd.core.stopping import clip_emitted
from spececd.edge.drafter import Drafter
from spececd.protocol import messages as m
from spececd.protocol.messages import Fingerprint
from spececd.protocol.session import EdgeSession
from spececd.transports.base import Transport


@dataclass(frozen=True)
class RoundOutput:
    """Tokens one round emitted: the first ``from_draft`` are accepted drafts, the rest
    (at most one) came from the target."""

    token_ids: tuple[int, ...]
    from_draft: int
    finished: bool


class EdgeClient:
    def __init__(self, drafter: Drafter, connect: Callable[[], Transport],
                 fingerprint: Fingerprint, max_context: int, auth_token: str = "") -> None:
        self.drafter = drafter
        self.connect = connect
        self.fingerprint = fingerprint
        self.max_context = max_context
        self.auth_token = auth_token

    def rounds(self, prompt_ids: list[int], params: SamplingParams, mode: Mode, k: int,
               stats: GenerationStats) -> Iterator[RoundOutput]:
        """Generate after ``prompt_ids`` (``params.seed`` must be set), one round at a time."""
        assert params.seed is not None
        session = EdgeSession(self.fingerprint, mode, params, self.auth_token)
        transport = self.connect()
        start = time.perf_counter()
        try:
            transport.send(session.hello())
            welcome = session.receive(transport.recv())
            assert isinstance(welcome, m.Welcome)
            max_context = min(self.max_context, welcome.max_context)
            max_draft = min(k, welcome.max_draft)
            history = list(prompt_ids)
            generated = 0
            while True:
                remaining = params.max_tokens - generated
                room = max_context - len(history)  # positions left, the verifier's token included
                k_round = max(0, min(max_draft, remaining - 1, room - 1))
                t0 = time.perf_counter()
                tokens, dists = self.drafter.draft(history, k_round, mode, params, params.seed)
                stats.draft_s += time.perf_counter() - t0
                transport.send(session.draft(history, tokens, dists))
                verdict = session.receive(transport.recv())
                assert isinstance(verdict, m.Verdict)
                stats.record_round(len(tokens), verdict.num_accepted)
                stats.verify_s += verdict.verify_s
                emitted = (*tokens[:verdict.num_accepted], verdict.next_token)
                history.extend(emitted)
                out, finished = clip_emitted(emitted, params.stop_token_ids, remaining)
                generated += len(out)
                stats.generated += len(out)
                finished = finished or len(history) >= max_context
                yield RoundOutput(tuple(out), min(verdict.num_accepted, len(out)), finished)
                if finished:
                    transport.send(m.encode(m.Close("done")))
                    return
        finally:
            stats.wall_s += time.perf_counter() - start
            transport.close()
