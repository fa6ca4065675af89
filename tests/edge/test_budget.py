"""The edge hears its budget (protocol 7): the server's verdicts and tokens frames say how
many positions of the next draft or hint it expects to verify, and the edge drafts no more
than that; against a server older than protocol 7 the edge greets again without asking for
it. The toy pair, in process, no torch: a transport rewrites the server's replies to carry
a budget, as a loaded server's would."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from spececd.backends.base import tokenizer_fingerprint
from spececd.core.params import SamplingParams
from spececd.core.stats import GenerationStats
from spececd.edge.client import EdgeClient
from spececd.edge.drafter import Drafter
from spececd.edge.options import EdgeOptions, Resolved, Site
from spececd.protocol import messages as m
from spececd.transports.memory import LocalServer, MemoryTransport, local_verifier
from tests.toy import ToyBackend, greedy

PROMPT = list(b"for key in ")
N = 40


class Budgeted(MemoryTransport):
    """A link that records the frames it sends and gives every verdict and tokens frame
    the budget ``budget``."""

    def __init__(self, server: LocalServer, budget: int) -> None:
        super().__init__(server)
        self.budget = budget
        self.sent: list[m.Message] = []

    def send(self, frame: bytes) -> None:
        self.sent.append(m.decode(frame))
        super().send(frame)

    def _received(self, frame: bytes | None) -> bytes:
        data = super()._received(frame)
        reply = m.decode(data)
        if isinstance(reply, m.Verdict | m.Tokens):
            return m.encode(dataclasses.replace(reply, budget=self.budget))
        return data


@pytest.fixture()
def verifier(toy: tuple[ToyBackend, ToyBackend]) -> Iterator[LocalServer]:
    server = local_verifier(toy[1])
    yield server
    server.close()


def generate(draft: ToyBackend, transport: MemoryTransport, **options: object) -> list[int]:
    fingerprint = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
    client = EdgeClient(Drafter(draft), lambda: transport, fingerprint, draft.max_context)
    run = Resolved(EdgeOptions().with_settings(**options).resolved(Site(in_process=False)),
                   SamplingParams(temperature=0.0, seed=1, max_tokens=N))
    try:
        return [t for out in client.generate(PROMPT, run, GenerationStats())
                for t in out.token_ids]
    finally:
        client.close()


@pytest.mark.parametrize("proactive", ["off", "on"])
def test_rounds_draft_no_more_than_the_budget(toy: tuple[ToyBackend, ToyBackend],
                                              verifier: LocalServer, proactive: str) -> None:
    draft, target = toy
    transport = Budgeted(verifier, budget=2)
    assert generate(draft, transport, k=6, proactive=proactive) == greedy(target, PROMPT, N)
    hello = transport.sent[0]
    assert isinstance(hello, m.Hello) and hello.protocol_version == m.BUDGET_VERSION
    drafts = [len(f.tokens) for f in transport.sent if isinstance(f, m.Draft)]
    assert drafts[0] == 6 and max(drafts[1:]) == 2  # the first before any budget was heard


def test_stream_drafting_hints_no_deeper_than_the_budget(toy: tuple[ToyBackend, ToyBackend],
                                                         verifier: LocalServer) -> None:
    draft, target = toy
    target.pass_s = 0.002  # a step long enough for hints to go out between them
    transport = Budgeted(verifier, budget=0)
    assert generate(draft, transport, k=6, proactive="stream") == greedy(target, PROMPT, N)
    assert not [f for f in transport.sent[2:] if isinstance(f, m.Hint)]  # 0: no hints at all


def test_an_edge_greets_an_older_server_without_the_budget(
        toy: tuple[ToyBackend, ToyBackend], verifier: LocalServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    draft, target = toy
    monkeypatch.setattr(m, "COMPATIBLE_VERSIONS", (2, 3, 4, 5, 6))  # a protocol-6 server
    opened: list[Budgeted] = []

    def connect() -> Budgeted:
        opened.append(Budgeted(verifier, budget=3))
        return opened[-1]

    fingerprint = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
    client = EdgeClient(Drafter(draft), connect, fingerprint, draft.max_context)
    run = Resolved(EdgeOptions().with_settings(k=4).resolved(Site(in_process=False)),
                   SamplingParams(temperature=0.0, seed=1, max_tokens=N))
    try:
        out = [t for o in client.generate(PROMPT, run, GenerationStats()) for t in o.token_ids]
    finally:
        client.close()
    assert out == greedy(target, PROMPT, N)
    assert len(opened) == 2  # refused, then greeted again on a new connection
    hellos = [f for t in opened for f in t.sent if isinstance(f, m.Hello)]
    versions = [h.protocol_version for h in hellos]  # auto's stream session greets too
    assert versions[0] == m.BUDGET_VERSION and set(versions[1:]) == {2}
