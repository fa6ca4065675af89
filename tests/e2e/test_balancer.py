"""Three `spececd serve` replicas behind Debian's nginx, configured by
:func:`spececd.deploy.nginx_conf` (the renderer of deploy/nginx.conf), on loopback.

Sixteen sessions, greedy and sampled (with the default ``--proactive auto``, which rounds
or streams as it measures, and with block-ahead rounds), generate 64 tokens each through
the balancer: first undisturbed (every HTTP request of a link must reach its replica: no
session may need a reconnection), then while one replica is killed, another drained and
restarted and the third paused for longer than the edge's round timeout. Every output
must be identical to its undisturbed reference. The run prints the reconnections per
session and the stalls (the longest waits for a chunk).
"""

from __future__ import annotations

import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from spececd.core.stats import GenerationStats
from spececd.deploy import Ports, loopback, nginx_conf
from spececd.edge.options import Reconnect
from spececd.generator import Generator
from tests.e2e.server import NginxProcess, ServerProcess, free_ports
from tests.reference import PROMPTS

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None,
                                reason="nginx is not installed (apt-get install nginx-light)")

SESSIONS = 16
TOKENS = 64
ROUND_TIMEOUT = 3.0  # the edge's; the paused replica stays paused longer
DRAIN_TIMEOUT = 5.0
SCHEMES = {"websocket": "ws", "http": "http", "grpc": "grpc"}


class Cluster:
    """Three replicas and nginx in front of them."""

    def __init__(self, model: Path, runtime_dir: Path) -> None:
        free = free_ports(12)
        ports = [Ports(*free[i:i + 3]) for i in (0, 3, 6)]
        self.listen = Ports(*free[9:])
        self.replicas: list[ServerProcess] = []
        self.nginx: NginxProcess | None = None
        try:
            for p in ports:
                self.replicas.append(ServerProcess(
                    model, "--grpc-port", str(p.grpc), "--http-port", str(p.http),
                    "--drain-timeout", f"{DRAIN_TIMEOUT:g}", port=p.websocket))
            self.nginx = NginxProcess(nginx_conf(loopback(ports, self.listen),
                                                 str(runtime_dir), "127.0.0.1"), runtime_dir)
        except BaseException:
            self.stop()
            raise

    def url(self, transport: str) -> str:
        return f"{SCHEMES[transport]}://127.0.0.1:{getattr(self.listen, transport)}"

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
        for replica in self.replicas:
            assert replica.proc is not None
            if replica.alive():
                replica.proc.send_signal(signal.SIGCONT)
            replica.stop()


@pytest.fixture(scope="module")
def cluster(tiny_models: dict[str, Path]) -> Iterator[Cluster]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="spececd-nginx-"))
    runtime_dir.chmod(0o755)  # nginx's workers (nobody) write their temporary files here
    cluster = Cluster(tiny_models["llama"], runtime_dir)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)


class Gates:
    """Sessions pause at token counts until the test has done what it does there."""

    def __init__(self, at: list[int]) -> None:
        self.at = at
        self.opened = [threading.Event() for _ in at]
        self.waiting = [0] * len(at)
        self.finished = 0
        self.lock = threading.Condition()

    def passing(self, tokens: int) -> None:
        for i, at in enumerate(self.at):
            if tokens >= at and not self.opened[i].is_set():
                with self.lock:
                    self.waiting[i] += 1
                    self.lock.notify_all()
                self.opened[i].wait(120)

    def done(self) -> None:
        with self.lock:
            self.finished += 1
            self.lock.notify_all()

    def open(self, i: int, then: Callable[[], None]) -> None:
        """Wait until every session waits at gate ``i`` or has finished, let them go on,
        and do ``then`` while their rounds are under way."""
        with self.lock:
            assert self.lock.wait_for(lambda: self.waiting[i] + self.finished >= SESSIONS, 120)
        self.opened[i].set()
        time.sleep(0.05)
        then()


def run_sessions(gen: Generator, gates: Gates | None = None
                 ) -> tuple[list[list[int]], list[int], list[list[float]]]:
    """The 16 sessions at once: their tokens, their reconnections, and each one's waits for
    a chunk (time blocked at a gate left out)."""
    tokens: list[list[int]] = [[] for _ in range(SESSIONS)]
    reconnects = [0] * SESSIONS
    waits: list[list[float]] = [[] for _ in range(SESSIONS)]
    errors: list[BaseException] = []

    def session(i: int) -> None:
        # Half greedy, half sampled; half in block-ahead rounds (so that rounds are in
        # flight when a replica fails), half with the default `auto`, which soon streams
        # (and then often has its tokens before a disruption). Sampled, in the two ways
        # whose tokens a seed fixes whatever the timing: exact mode with a fixed k and a
        # fixed strategy, and match mode (rounds or streams, each token is the target's
        # own draw for its position).
        sampling: dict[str, Any] = (dict(temperature=0.0) if i % 2 == 0 else
                                    dict(temperature=0.9, seed=100 + i))
        options = gen.options.with_settings(**(
            {"proactive": "on"} if i % 4 < 2 else {"mode": "match"} if i % 4 == 3 else {}))
        stats = GenerationStats()
        try:
            chunks = gen.stream(PROMPTS[i % len(PROMPTS)], stats, max_tokens=TOKENS,
                                stop_token_ids=[], options=options, **sampling)
            while True:
                start = time.monotonic()
                chunk = next(chunks, None)
                waits[i].append(time.monotonic() - start)
                if chunk is None:
                    break
                tokens[i].extend(chunk.token_ids)
                if gates is not None:
                    gates.passing(len(tokens[i]))
        except BaseException as exc:
            errors.append(exc)
        finally:
            reconnects[i] = stats.reconnects
            if gates is not None:
                gates.done()

    threads = [threading.Thread(target=session, args=(i,)) for i in range(SESSIONS)]
    for thread in threads:
        thread.start()
    return_after = time.monotonic() + 300
    for thread in threads:
        thread.join(max(0.0, return_after - time.monotonic()))
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    return tokens, reconnects, waits


# gRPC streams are pinned by being one stream, as WebSocket connections are by being one
# connection: its run (about 18 s) is in the slow suite, to keep the default one in budget.
@pytest.mark.parametrize("transport", ["websocket", "http",
                                       pytest.param("grpc", marks=pytest.mark.slow)])
def test_replicas_behind_nginx_lose_no_session(cluster: Cluster, tiny_models: dict[str, Path],
                                               transport: str) -> None:
    a, b, c = cluster.replicas
    with Generator.load(str(tiny_models["draft"]), server=cluster.url(transport), device="cpu",
                        dtype="float32", k=4, round_timeout=ROUND_TIMEOUT,
                        reconnect=Reconnect(delay=0.2, max_delay=1.0, timeout=60.0)) as gen:
        reference, reconnects, _ = run_sessions(gen)
        assert all(len(t) == TOKENS for t in reference)
        # Affinity: every request of a link reached the replica that holds it.
        assert reconnects == [0] * SESSIONS

        def kill() -> None:
            a.kill()

        def drain_and_restart() -> None:
            assert b.proc is not None
            b.proc.send_signal(signal.SIGTERM)
            assert b.proc.wait(DRAIN_TIMEOUT + 10) == 0
            b.start()

        def pause() -> None:
            assert c.proc is not None
            c.proc.send_signal(signal.SIGSTOP)
            time.sleep(ROUND_TIMEOUT + 2.0)
            c.proc.send_signal(signal.SIGCONT)

        gates = Gates([12, 28, 44])
        disturb = threading.Thread(target=lambda: [
            gates.open(i, then) for i, then in enumerate((kill, drain_and_restart, pause))])
        disturb.start()
        tokens, reconnects, waits = run_sessions(gen, gates)
        disturb.join(120)
        a.start()  # the next transport's run starts with three replicas again

    for i in range(SESSIONS):
        assert tokens[i] == reference[i], f"session {i} differs from its reference"
    assert sum(reconnects) >= 3  # the disruptions did reach sessions
    every = sorted(w for session in waits for w in session)
    longest = sorted(max(session) for session in waits)
    print(f"\n{transport} through nginx: reconnections per session {reconnects} (total "
          f"{sum(reconnects)}); longest wait for a chunk per session: median "
          f"{statistics.median(longest):.2f} s, max {longest[-1]:.2f} s; all waits: p99 "
          f"{every[int(0.99 * (len(every) - 1))]:.2f} s")


def test_a_page_served_through_nginx_opens_sessions_and_another_sites_does_not(
        cluster: Cluster) -> None:
    """nginx passes the browser's Host on, so a page of the balancer's own origin may open a
    session on a replica (which lets in pages of the host asked for), and another site's may
    not (403)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = cluster.url("websocket")
    own = f"http://127.0.0.1:{cluster.listen.websocket}"
    with connect(url, origin=own, open_timeout=10) as ws:  # type: ignore[arg-type]
        ws.send(b"")  # opened: the replica answers a frame it cannot read with an error
    with pytest.raises(InvalidStatus) as refused:
        connect(url, origin="https://elsewhere.example", open_timeout=10)  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
