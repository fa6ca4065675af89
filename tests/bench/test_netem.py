"""The delay proxy adds the one-way delay in each direction, over real sockets.

How much it adds is checked on a virtual clock that moves only when the proxy sleeps, so
that the figure is exact whatever the machine's load; on the real clock, only that it
holds the bytes at least that long (a bound no slow machine can break).
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from types import ModuleType

import pytest

from spececd.bench import netem
from spececd.bench.netem import DelayProxy


@pytest.fixture()
def echo_port() -> int:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(4096):
                conn.sendall(data)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return int(server.getsockname()[1])


def median_rtt_ms(port: int, rounds: int = 15) -> float:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for i in range(rounds):
            payload = bytes([i]) * 100
            start = time.perf_counter()
            sock.sendall(payload)
            received = b""
            while len(received) < len(payload):
                received += sock.recv(4096)
            rtts.append((time.perf_counter() - start) * 1000)
            assert received == payload
    return statistics.median(rtts)


@pytest.mark.parametrize("delay_ms", [0, 10, 25])
def test_round_trip_is_at_least_twice_the_delay(echo_port: int, delay_ms: float) -> None:
    with DelayProxy("127.0.0.1", echo_port, delay_ms) as proxy:
        rtt = median_rtt_ms(proxy.port)
    print(f"one-way {delay_ms} ms: round trip {rtt:.2f} ms")
    assert 2 * delay_ms <= rtt  # each direction holds the bytes for the delay


class VirtualClock:
    """The proxy's ``time.monotonic`` and ``asyncio.sleep``: time moves only when the
    proxy sleeps, by what it sleeps. With one message in flight, a round trip through the
    proxy then lasts exactly the delays it added."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)

    def asyncio(self) -> ModuleType:
        """The asyncio module as the proxy sees it: the same, but for ``sleep``."""
        module = ModuleType("asyncio")
        module.__dict__.update(vars(asyncio))
        module.sleep = self.sleep  # type: ignore[attr-defined]
        return module


@pytest.mark.parametrize("delay_ms", [0, 10, 25])
def test_each_direction_adds_the_delay_exactly_once(echo_port: int, delay_ms: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a delay applied twice, in one direction only, or counted from the
    previous delivery instead of the chunk's arrival (it would grow round after round)."""
    clock = VirtualClock()
    monkeypatch.setattr(netem, "time", clock)
    monkeypatch.setattr(netem, "asyncio", clock.asyncio())
    with DelayProxy("127.0.0.1", echo_port, delay_ms) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(5):
            start = clock.now
            sock.sendall(bytes([i]) * 100)
            received = b""
            while len(received) < 100:
                received += sock.recv(4096)
            assert received == bytes([i]) * 100
            assert clock.now - start == pytest.approx(2 * delay_ms / 1000)


def test_jitter_keeps_the_byte_stream_in_order(echo_port: int) -> None:
    with DelayProxy("127.0.0.1", echo_port, 2, jitter_ms=5, seed=1) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sent = bytes(range(256)) * 40
        for i in range(0, len(sent), 512):
            sock.sendall(sent[i:i + 512])
        received = b""
        while len(received) < len(sent):
            received += sock.recv(65536)
    assert received == sent


def test_stopping_with_a_connection_open_logs_no_error(
        echo_port: int, caplog: pytest.LogCaptureFixture) -> None:
    """The bench stops its proxy while edges are still connected: that is no error."""
    proxy = DelayProxy("127.0.0.1", echo_port, 1).start()
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"x")
        assert sock.recv(1) == b"x"
        with caplog.at_level("ERROR", logger="asyncio"):
            proxy.stop()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
