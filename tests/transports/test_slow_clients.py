"""Slow clients on the verifier's listeners (slowloris: one byte a second): the HTTP
listener answers a request not sent whole within the request timeout with a 408 in the
typed shape, the WebSocket listener drops a handshake not done within it, and a
legitimate session beside them finishes with the target's own output. The timeout is one
second here (``Listener.request_timeout``; ``spececd serve --request-timeout``,
default 10 s).

After its handshake a WebSocket client that trickles a frame is cut off by the
keepalive ping it cannot answer mid-frame (websockets' 20 s interval and 20 s timeout):
the slow-marked test shows it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from spececd.cloud.runners import builtin_service
from spececd.edge.options import EdgeOptions
from spececd.generator import Generator
from spececd.transports import registry
from tests.support.servers import ThreadServer
from tests.toy import ToyBackend, ToyModel, greedy
from tests.trickle import trickle

pytest.importorskip("grpc")

TIMEOUT = 1.0
PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ThreadServer, ToyBackend]]:
    target = ToyBackend(ToyModel(seed=0), pass_s=0.002)
    engine = builtin_service(target)
    server = ThreadServer(engine, registry.TRANSPORTS, request_timeout=TIMEOUT,
                          close_engine=False)
    yield server, target
    server.stop()
    engine.close()


class Beside:
    """A legitimate edge generating again and again over ``url`` while the test runs."""

    def __init__(self, url: str, target: ToyBackend) -> None:
        self.url, self.expected = url, greedy(target, PROMPT, 24)
        self.outputs: list[list[int]] = []
        self.running = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def __enter__(self) -> Beside:
        self.running.set()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running.clear()
        self.thread.join(60)

    def _run(self) -> None:
        gen = Generator(ToyBackend(ToyModel(seed=1)), registry.connector(self.url),
                        max_context=4096, options=EdgeOptions().with_settings(k=3))
        with gen:
            while self.running.is_set() or not self.outputs:
                out = gen.generate(PROMPT, max_tokens=24, temperature=0, stop_token_ids=[])
                self.outputs.append(list(out.token_ids))

    def check(self) -> None:
        assert self.outputs and all(out == self.expected for out in self.outputs)


@pytest.mark.parametrize("part", ["head", "body"])
def test_the_http_listener_answers_a_slow_request_408(
        served: tuple[ThreadServer, ToyBackend], part: str) -> None:
    server, target = served
    port = int(server.urls["http"].rsplit(":", 1)[1])
    body = b"{}"
    head = (b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\n\r\n")
    with Beside(server.urls["ws"], target) as beside:
        if part == "head":
            took, answer = trickle(port, head + body, 10)
        else:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(head + body[:1])
            started = time.monotonic()
            sock.settimeout(10)
            answer = sock.recv(65536)
            took = time.monotonic() - started
            sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert TIMEOUT - 0.1 <= took < TIMEOUT + 2.5
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout"
    beside.check()


def test_the_websocket_listener_drops_a_slow_handshake(
        served: tuple[ThreadServer, ToyBackend]) -> None:
    server, target = served
    port = int(server.urls["ws"].rsplit(":", 1)[1])
    handshake = (b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 b"Sec-WebSocket-Version: 13\r\n\r\n")
    with Beside(server.urls["http"], target) as beside:
        took, answer = trickle(port, handshake, 10)
    assert took < TIMEOUT + 2.5  # closed, long before the handshake was sent
    assert not answer.startswith(b"HTTP/1.1 101"), answer[:200]
    beside.check()


@pytest.mark.slow
def test_a_websocket_client_stalling_mid_frame_is_cut_off_by_the_keepalive(
        served: tuple[ThreadServer, ToyBackend]) -> None:
    server, target = served
    port = int(server.urls["ws"].rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 b"Sec-WebSocket-Version: 13\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 101")
    frame = bytes([0x82, 0xFE, 0x10, 0x00, 1, 2, 3, 4]) + bytes(4096)  # masked, 4 KiB
    started, closed = time.monotonic(), False
    with Beside(server.urls["http"], target) as beside:
        sock.setblocking(False)
        for byte in frame:
            if time.monotonic() - started > 90:
                break
            try:
                sock.sendall(bytes([byte]))
                while True:  # pings and, at the end, the close: never answered
                    if not sock.recv(65536):
                        closed = True
                        break
            except BlockingIOError:
                pass
            except OSError:
                closed = True
            if closed:
                break
            time.sleep(1.0)
    sock.close()
    took = time.monotonic() - started
    assert closed and took < 60, took
    beside.check()
