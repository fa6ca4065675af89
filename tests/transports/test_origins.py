"""Which web pages may open a session on `spececd serve`'s WebSocket: a browser names its
page's origin in the handshake, so without a check any site the user visits could generate
on a server on their machine. The server's own page may, and the origins it is started with
(``--allowed-origin``); clients that are no browser send no origin and may."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from spececd.cloud.builtin import BuiltinRunner
from spececd.cloud.metrics import Metrics
from spececd.cloud.service import CloudService
from spececd.protocol import messages as m
from spececd.transports.websocket import allowed_origins, origin_allowed
from tests.support.protocol import hello
from tests.support.servers import ThreadServer
from tests.toy import ToyBackend, ToyModel

ALLOWED = "https://app.example"


@pytest.fixture(scope="module")
def served() -> Iterator[ThreadServer]:
    target = ToyBackend(ToyModel(seed=0))
    server = ThreadServer(CloudService(BuiltinRunner(target, Metrics())), ("websocket",),
                          allowed_origins=(ALLOWED,))
    yield server
    server.stop()


def opens(served: ThreadServer, origin: str | None, host: str = "127.0.0.1") -> bool:
    """Whether a handshake with ``origin``, to the server reached as ``host``, opens a
    session that answers a hello; False when the server refuses it with 403."""
    try:
        with connect(f"ws://{host}:{served.port}", origin=origin,  # type: ignore[arg-type]
                     open_timeout=10) as ws:
            ws.send(hello(ToyBackend(ToyModel(seed=0))))
            return isinstance(m.decode(ws.recv(10)), m.Welcome)
    except InvalidStatus as exc:
        assert exc.response.status_code == 403
        assert b"--allowed-origin" in exc.response.body
        return False


def exchange(served: ThreadServer, request: bytes) -> bytes:
    """``request`` sent as raw bytes, and all the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def test_the_servers_own_page_and_clients_without_a_page_open_sessions(
        served: ThreadServer) -> None:
    assert opens(served, None)
    assert opens(served, f"http://127.0.0.1:{served.port}")
    assert opens(served, f"http://localhost:{served.port}", host="localhost")


def test_an_allowed_origin_opens_a_session_and_any_other_site_is_refused(
        served: ThreadServer) -> None:
    assert opens(served, ALLOWED)
    assert not opens(served, "https://evil.example")
    assert not opens(served, f"http://127.0.0.1:{served.port + 1}")  # another local port
    assert not opens(served, "null")  # a sandboxed frame or a file


def test_a_handshake_with_two_hosts_or_origins_is_refused_not_an_error(
        served: ThreadServer) -> None:
    for name in ("Host", "Origin", "Upgrade"):
        handshake = ("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                     "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                     "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nOrigin: http://127.0.0.1\r\n"
                     f"{name}: websocket\r\n\r\n")
        reply = exchange(served, handshake.encode())
        assert reply.startswith(b"HTTP/1.1 400") and name.encode() in reply, (name, reply)


def test_the_origin_rule() -> None:
    assert origin_allowed(None, "h:1", ())  # no browser
    assert origin_allowed("http://127.0.0.1:1", "127.0.0.1:1", ())
    assert origin_allowed("https://LOCALHOST:1", "localhost:1", ())
    assert origin_allowed("http://[::1]:1", "[::1]:1", ())
    assert origin_allowed("http://10.0.0.5:8765", "10.0.0.5:8765", ())  # an address: its own
    assert not origin_allowed("ftp://127.0.0.1:1", "127.0.0.1:1", ())
    assert not origin_allowed("http://127.0.0.1:1", None, ())
    # DNS rebinding: a site pointing its own name at 127.0.0.1 sends a Host that matches.
    assert not origin_allowed("http://evil.example:8765", "evil.example:8765", ())
    # A name other than localhost is let in by name, as browsers send it.
    named = allowed_origins(["HTTP://GPU-box:8765/"])
    assert named == ("http://gpu-box:8765",)
    assert origin_allowed("http://gpu-box:8765", "gpu-box:8765", named)
    assert origin_allowed("https://x", "h:1", ("*",))


def test_a_page_request_with_its_etag_over_two_lines_is_answered(served: ThreadServer) -> None:
    """HTTP lets a request split If-None-Match over several lines: the page's files are
    revalidated against all of them (it was a 500)."""
    from spececd.transports.web import BUILT

    if not (BUILT / "index.html").is_file():
        pytest.skip("the browser edge is not built: run `npm ci && npm run build` in web/")

    def get(extra: str) -> bytes:
        return exchange(served, f"GET /app.js HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n"
                        .encode())

    first = get("")
    assert first.startswith(b"HTTP/1.1 200")
    tag = next(line.split(b": ", 1)[1] for line in first.split(b"\r\n")
               if line.lower().startswith(b"etag:")).decode()
    again = get(f'If-None-Match: "other"\r\nIf-None-Match: {tag}\r\n')
    assert again.startswith(b"HTTP/1.1 304"), again[:200]
