"""An engine that fails under a live server, over each networked transport: an edge that
is connected and idle gets a fatal ``engine_failed`` error naming the cause at its next
generation (no reconnection window), and so does an edge that connects while the server
drains. The target is the torch-free toy; its runner is gone for good once one pass
failed (:class:`tests.cloud.test_service.DyingRunner`), as vLLM's engine is once its
worker dies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from spececd.cloud.metrics import Metrics
from spececd.cloud.service import CloudService
from spececd.edge.options import EdgeOptions
from spececd.generator import Generator
from spececd.protocol import messages as m
from spececd.protocol.errors import EngineFailed
from spececd.transports import registry
from tests.cloud.test_service import DyingRunner, RecordingFailingBackend
from tests.support.protocol import hello
from tests.support.servers import ThreadServer
from tests.toy import ToyBackend, ToyModel, greedy

pytest.importorskip("grpc")

PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture()
def dying() -> Iterator[tuple[ThreadServer, ToyBackend, int]]:
    target = ToyBackend(ToyModel(seed=0))
    expected = greedy(target, PROMPT, 8)
    poison = next(t for t in range(target.vocab_size) if t not in (*expected, *PROMPT))
    metrics = Metrics()
    runner = DyingRunner(RecordingFailingBackend(target, poison), metrics)
    served = ThreadServer(CloudService(runner, metrics=metrics), registry.TRANSPORTS,
                           close_engine=False)
    yield served, target, poison
    served.stop()


@pytest.mark.parametrize("scheme", ["ws", "grpc", "http"])
def test_a_connected_edge_gets_the_cause_at_once(
        scheme: str, dying: tuple[ThreadServer, ToyBackend, int]) -> None:
    served, target, poison = dying
    url = served.urls[scheme]
    gen = Generator(ToyBackend(ToyModel(seed=1)), registry.connector(url, recv_timeout=10),
                    max_context=4096, options=EdgeOptions().with_settings(k=3))
    with gen:
        ok = gen.generate(PROMPT, max_tokens=8, temperature=0, stop_token_ids=[])
        assert list(ok.token_ids) == greedy(target, PROMPT, 8)
        killer = registry.connector(served.urls["ws"], recv_timeout=10)()
        killer.send(hello(target))
        assert isinstance(m.decode(killer.recv()), m.Welcome)
        killer.send(m.encode(m.Draft(1, 0, tuple(PROMPT), (poison,))))
        reply = m.decode(killer.recv())
        assert isinstance(reply, m.Error) and reply.code == "engine_failed"
        killer.close()
        started = time.monotonic()
        with pytest.raises(EngineFailed, match="device lost"):
            gen.generate(PROMPT, max_tokens=8, temperature=0, stop_token_ids=[])
        assert time.monotonic() - started < 5  # not the reconnection window
