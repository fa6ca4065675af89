"""The edge's link to the verifier (:mod:`spececd.edge.link`) through a scripted
transport that fails when told: a reconnection re-sends the whole history to a verifier
that holds none of it (a restarted server) and the output is that of an uninterrupted
run; a verifier that stays away ends in :class:`CloudUnreachable`, or in the draft alone
with ``fallback="draft"``. The toy pair, in process, no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from spececd.backends.base import tokenizer_fingerprint
from spececd.core.params import SamplingParams
from spececd.core.stats import GenerationStats
from spececd.edge.client import EdgeClient
from spececd.edge.drafter import Drafter
from spececd.edge.link import CloudUnreachable
from spececd.edge.options import EdgeOptions, Reconnect, Resolved, Site
from spececd.edge.transport import Transport
from spececd.protocol import messages as m
from spececd.transports.memory import LocalServer, MemoryTransport, local_verifier
from tests.toy import ToyBackend, greedy

PROMPT = list(b"for key in ")
N = 30
NO_WAIT = Reconnect(attempts=3, delay=0.0, max_delay=0.0, timeout=30.0)


class Scripted(MemoryTransport):
    """A link to ``server`` that records every frame it sends (decoded) and raises
    ``ConnectionError`` on its ``fail_at``-th send (0: never), as a dropped connection
    does; that frame is lost."""

    def __init__(self, server: LocalServer, fail_at: int = 0) -> None:
        super().__init__(server)
        self.fail_at = fail_at
        self.sent: list[m.Message] = []

    def send(self, frame: bytes) -> None:
        if len(self.sent) + 1 == self.fail_at:
            self.close()
            raise ConnectionError("scripted: the connection dropped")
        self.sent.append(m.decode(frame))
        super().send(frame)


@pytest.fixture()
def servers(toy: tuple[ToyBackend, ToyBackend]) -> Iterator[list[LocalServer]]:
    """Two verifiers of the same target: the first, and the one a reconnection reaches
    (a restarted server or another replica, with no session and no cache)."""
    made = [local_verifier(toy[1]), local_verifier(toy[1])]
    yield made
    for server in made:
        server.close()


def edge(draft: ToyBackend, connect: Callable[[], Transport],
         **options: object) -> tuple[EdgeClient, EdgeOptions]:
    fingerprint = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
    return (EdgeClient(Drafter(draft), connect, fingerprint, draft.max_context),
            EdgeOptions(reconnect=NO_WAIT).with_settings(**options))


def generate(client: tuple[EdgeClient, EdgeOptions], stats: GenerationStats) -> list[int]:
    run = Resolved(client[1].resolved(Site(in_process=False)),
                   SamplingParams(temperature=0.0, seed=1, max_tokens=N))
    return [t for out in client[0].generate(PROMPT, run, stats) for t in out.token_ids]


@pytest.mark.parametrize("proactive", ["off", "on", "stream"])
def test_a_reconnection_re_sends_the_history_and_changes_nothing(
        toy: tuple[ToyBackend, ToyBackend], servers: list[LocalServer], proactive: str) -> None:
    draft, target = toy
    # A target as slow as a real one: an instant one can stream the whole generation
    # before the edge has sent the frame the link is to fail at.
    target.pass_s = 0.002
    transports = [Scripted(servers[0], fail_at=4), Scripted(servers[1])]
    opened: list[Scripted] = []

    def connect() -> Scripted:
        opened.append(transports[len(opened)])
        return opened[-1]

    stats = GenerationStats()
    assert generate(edge(draft, connect, k=3, proactive=proactive), stats) == \
        greedy(target, PROMPT, N)
    assert stats.reconnects == 1 and len(opened) == 2
    # The new server holds nothing: the first request on the new connection carries
    # everything from the start (a session that re-sent only what the old server lacked
    # would leave this one without the prompt: a wrong verdict or a typed error).
    hello, first = transports[1].sent[:2]
    assert isinstance(hello, m.Hello)
    assert isinstance(first, (m.Draft, m.Generate))
    assert first.context_len == 0 and first.prefix[:len(PROMPT)] == tuple(PROMPT)
    assert len(first.prefix) > len(PROMPT)  # it had generated tokens before the drop


def test_an_unreachable_verifier_raises_after_the_attempts_allowed(
        toy: tuple[ToyBackend, ToyBackend]) -> None:
    tries = []

    def connect() -> MemoryTransport:
        tries.append(1)
        raise ConnectionError("scripted: refused")

    stats = GenerationStats()
    with pytest.raises(CloudUnreachable, match="3 reconnection attempts"):
        generate(edge(toy[0], connect, k=3, proactive="off"), stats)
    assert len(tries) == 1 + NO_WAIT.attempts  # type: ignore[operator]
    assert stats.reconnects == NO_WAIT.attempts


def test_with_fallback_the_draft_finishes_alone_and_says_so(
        toy: tuple[ToyBackend, ToyBackend]) -> None:
    draft, _ = toy

    def connect() -> MemoryTransport:
        raise ConnectionError("scripted: refused")

    stats = GenerationStats()
    out = generate(edge(draft, connect, k=3, proactive="off", fallback="draft"), stats)
    assert out == greedy(draft, PROMPT, N)  # the draft's own greedy output, whole
    assert stats.fallback and stats.fallback_tokens == N
