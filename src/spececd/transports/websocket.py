"""WebSocket transport: binary frames over the ``websockets`` library, both sides.

Server: :func:`serve` puts an :class:`~spececd.cloud.service.CloudService` behind
``websockets.asyncio.server``. One connection is one engine link: each binary frame read
goes into it, and every reply goes back as a binary frame. How the link ends decides the
close code: 1000 when the session closed, 1001 after the idle timeout, 1013 when the
server was full. Plain HTTP on the same port: the operators' endpoints of
:mod:`spececd.transports.ops` (health, readiness, status, metrics, the tokenizer) and the
browser edge's page (:mod:`spececd.transports.web`).

Client: :class:`WebSocketTransport` is a blocking transport for the edge loop. Every way
the link can fail (refused, reset, closed, timed out) surfaces as ``ConnectionError``, which
the edge answers by reconnecting and re-sending its history.

Compression is off: frames are tens of bytes and deflate would add to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.http11 import Request, Response
from websockets.sync.client import ClientConnection, connect

from spececd.cloud.service import CloudService, Ending
from spececd.edge.transport import AFFINITY_HEADER, affinity_key
from spececd.transports import ops
from spececd.transports.registry import REQUEST_TIMEOUT
from spececd.transports.tls import client_ssl_context, server_ssl_context
from spececd.transports.web import WebEdge

log = logging.getLogger(__name__)

__all__ = ["WebSocketTransport", "client_ssl_context", "serve", "server_ssl_context"]

WS_OVERHEAD = 64 * 1024  # room above the session's message limit before the socket refuses


def origin_allowed(origin: str | None, host: str | None, allowed: Sequence[str]) -> bool:
    """Whether a WebSocket handshake from a page of ``origin`` (its ``Origin`` header;
    None: not a browser, which sends none) may open a session on the server it reached as
    ``host`` (its ``Host`` header): the origins in ``allowed`` (lower case, no trailing
    slash: :func:`allowed_origins`; ``*``: any) may, and the server's own pages where the
    browser reached it by an address no other site can claim (``localhost``, an IP
    address). A browser sends every page's origin, so without this any site the user visits
    could generate on a server on their machine; and a site that points its own name at
    127.0.0.1 (DNS rebinding) sends a matching ``Host``, so a name other than ``localhost``
    must be allowed by name (``--allowed-origin http://gpu-box:8765``)."""
    if origin is None or "*" in allowed or origin.lower().rstrip("/") in allowed:
        return True
    parsed = urlsplit(origin)
    if parsed.scheme not in ("http", "https") or host is None:
        return False
    if parsed.netloc.lower() != host.lower():
        return False
    name = (parsed.hostname or "").rstrip(".")
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed_origins(origins: Sequence[str]) -> tuple[str, ...]:
    """``--allowed-origin`` values as browsers send origins: lower case, no trailing slash."""
    return tuple(origin.lower().rstrip("/") for origin in origins)


def _http_handler(engine: CloudService, web: WebEdge, allowed: Sequence[str]
                  ) -> Callable[[ServerConnection, Request], Awaitable[Response | None]]:
    async def process_request(connection: ServerConnection, request: Request
                              ) -> Response | None:
        endpoint = ops.BY_PATH.get(request.path)
        reply: ops.Reply | None
        if endpoint is not None:
            reply = endpoint.answer(engine)
        elif (twice := [name for name in ("Upgrade", "Origin", "Host")
                        if len(request.headers.get_all(name)) > 1]):
            return connection.respond(HTTPStatus.BAD_REQUEST,
                                      f"more than one {twice[0]} header: send one\n")
        elif request.headers.get("Upgrade", "").lower() == "websocket":
            origin = request.headers.get("Origin")
            if not origin_allowed(origin, request.headers.get("Host"), allowed):
                log.warning("refused a WebSocket handshake from origin %s", origin)
                return connection.respond(
                    HTTPStatus.FORBIDDEN,
                    f"origin {origin} may not open a session here: serve the page from this "
                    f"server, or start it with --allowed-origin {origin}\n")
            return None  # a WebSocket upgrade (at / too, where a browser gets the page)
        else:
            # (one header, or its values split over several lines, as HTTP allows)
            held = ", ".join(request.headers.get_all("If-None-Match")) or None
            reply = await web.answer(request.path, held)
            if reply is None:
                return None  # the upgrade refuses it (426)
        response = connection.respond(HTTPStatus(reply.status), "")  # Date, Connection: close
        for name in ("Content-Type", "Content-Length"):
            del response.headers[name]
        response.headers["Content-Type"] = reply.content_type
        if reply.status != HTTPStatus.NOT_MODIFIED:
            response.headers["Content-Length"] = str(len(reply.body))
        for name, value in reply.headers:
            response.headers[name] = value
        if endpoint is None or endpoint.name.startswith("tokenizer"):
            # The page and the tokenizer it reads, for a page served from another origin.
            response.headers["Access-Control-Allow-Origin"] = "*"
        return dataclasses.replace(response, body=reply.body)

    return process_request


CLOSE_CODES = {Ending.CLOSED: (1000, "session closed"), Ending.IDLE: (1001, "idle timeout"),
               Ending.REFUSED: (1013, "server busy"),
               Ending.DRAINED: (1012, "server shutting down")}


def _handler(engine: CloudService) -> Callable[[ServerConnection], Awaitable[None]]:
    async def handle(ws: ServerConnection) -> None:
        async def frames() -> AsyncIterator[bytes]:
            with contextlib.suppress(ConnectionClosed):  # the client left: the stream ends
                async for frame in ws:
                    yield frame if isinstance(frame, bytes) else frame.encode()

        try:
            ending = await engine.run(engine.open(), frames(), ws.send)
            if ending in CLOSE_CODES:
                await ws.close(*CLOSE_CODES[ending])
        except ConnectionClosed:
            pass  # the client left, maybe mid-round: nothing more to do for it

    return handle


async def serve(engine: CloudService, host: str, port: int, tls: tuple[str, str] | None = None,
                ready: Callable[[int], None] | None = None,
                request_timeout: float = REQUEST_TIMEOUT, web: WebEdge | None = None,
                origins: Sequence[str] = ()) -> None:
    """Serve until cancelled; ``tls``: PEM certificate and key (wss://); ``ready`` gets
    the port bound (``port`` 0: any free one); a handshake not done within
    ``request_timeout`` seconds is dropped; ``web``: what plain GETs other than the
    operators' endpoints answer (the browser edge's page and draft; default: the page);
    ``origins``: pages of other origins than the server's own that may open sessions
    (:func:`origin_allowed`; 403 for the rest)."""
    limit = engine.limits.max_message_bytes + WS_OVERHEAD
    context = server_ssl_context(*tls) if tls else None
    # open_timeout: a handshake not done within the request timeout (a client sending it
    # slowly) is dropped.
    async with ws_serve(_handler(engine), host, port, ssl=context, max_size=limit,
                        compression=None, process_request=_http_handler(
                            engine, web or WebEdge(), allowed_origins(origins)),
                        open_timeout=request_timeout) as ws_server:
        if ready is not None:
            ready(int(next(iter(ws_server.sockets)).getsockname()[1]))
        await asyncio.get_running_loop().create_future()


def frame_bytes(payload: int, masked: bool) -> int:
    """Bytes a WebSocket frame of ``payload`` bytes takes on the wire (RFC 6455 §5.2):
    the header, the client's masking key, the payload. TCP/IP headers are not counted."""
    header = 2 if payload < 126 else 4 if payload < 65536 else 10
    return header + (4 if masked else 0) + payload


class WebSocketTransport:
    """A blocking client connection to a verifier server."""

    def __init__(self, url: str, *, cafile: str | None = None, verify: bool = True,
                 auth_token: str = "", open_timeout: float = 10.0,
                 recv_timeout: float = 120.0, max_size: int = 16 << 20) -> None:
        self.url = url
        self.recv_timeout = recv_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        self._last_words: bytes | None = None  # see send()
        options: dict[str, Any] = dict(open_timeout=open_timeout, max_size=max_size,
                                       compression=None, proxy=None, legacy=True)
        if url.startswith("wss://"):
            options["ssl"] = client_ssl_context(cafile, verify)
        headers = {AFFINITY_HEADER: affinity_key()}  # for a balancer in front
        if auth_token:  # for a proxy in front; the server checks the hello's token
            headers["Authorization"] = f"Bearer {auth_token}"
        options["additional_headers"] = headers
        try:
            self._ws: ClientConnection = connect(url, **options)
        except InvalidURI as exc:
            raise ValueError(f"bad server URL {url!r}: {exc}") from None
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise ConnectionError(f"cannot connect to {url}: {exc}") from exc

    def send(self, frame: bytes) -> None:
        """Send ``frame``. A server that answered and closed before it could be sent (a
        fatal error: the server is full, draining or its engine failed) has its answer
        taken instead, for :meth:`recv` to return: the error, not a lost connection."""
        try:
            self._ws.send(frame)
        except (ConnectionClosed, OSError) as exc:
            try:
                self._last_words = self._ws.recv(timeout=0)  # type: ignore[assignment]
            except (ConnectionClosed, OSError, TimeoutError):
                raise ConnectionError(f"connection to {self.url} lost: {exc}") from exc
            return
        self.bytes_sent += frame_bytes(len(frame), masked=True)

    def recv(self) -> bytes:
        if self._last_words is not None:
            return self._received(self._last_words)
        try:
            frame = self._ws.recv(timeout=self.recv_timeout)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            raise ConnectionError(f"connection to {self.url} lost: {exc}") from exc
        return self._received(frame)

    def poll(self) -> bytes | None:
        """A frame that has already arrived, or None; never waits."""
        if self._last_words is not None:
            return self._received(self._last_words)
        try:
            frame = self._ws.recv(timeout=0)
        except TimeoutError:
            return None
        except (ConnectionClosed, OSError) as exc:
            raise ConnectionError(f"connection to {self.url} lost: {exc}") from exc
        return self._received(frame)

    def _received(self, frame: str | bytes) -> bytes:
        self._last_words = None
        data = frame if isinstance(frame, bytes) else frame.encode()
        self.bytes_received += frame_bytes(len(data), masked=False)
        return data

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken link must not raise
            self._ws.close()
