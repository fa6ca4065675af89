"""The transports by name: which client a server URL needs, and which listeners a server
opens. Each transport's module is imported only when used.

    scheme            transport   module
    ws://  wss://     websocket   transports/websocket.py
    grpc:// grpcs://  grpc        transports/grpc.py
    http:// https://  http        transports/http.py

Every listener feeds the same :class:`~spececd.cloud.service.CloudService` on one event loop, so a
server that opens several shares its sessions, batches, limits and metrics across them.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spececd.cloud.service import CloudService
from spececd.edge.transport import Transport
from spececd.errors import InputError
from spececd.transports.web import WebEdge

TRANSPORTS = ("websocket", "grpc", "http")
# Seconds a client has to send a whole HTTP request or WebSocket handshake (slowloris).
REQUEST_TIMEOUT = 10.0
SCHEMES = {"ws": "websocket", "wss": "websocket", "grpc": "grpc", "grpcs": "grpc",
           "http": "http", "https": "http"}
SECURE = {"wss", "grpcs", "https"}
_CLIENTS = {"websocket": "WebSocketTransport", "grpc": "GrpcTransport", "http": "HttpTransport"}


def scheme_of(url: str) -> str:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise InputError(f"server URL {url!r} must start with one of "
                         f"{', '.join(s + '://' for s in SCHEMES)}")
    return scheme


def connector(url: str, *, cafile: str | None = None, verify: bool = True,
              auth_token: str = "", open_timeout: float = 10.0, recv_timeout: float = 120.0
              ) -> Callable[[], Transport]:
    """A factory of links to the verifier at ``url`` (called again for each reconnection).
    ``cafile``/``verify``: how a TLS scheme checks the server's certificate;
    ``auth_token``: sent the transport's own way too (a bearer header or gRPC metadata),
    for the server and for proxies in front of it."""
    scheme = scheme_of(url)
    module = importlib.import_module(f"spececd.transports.{SCHEMES[scheme]}")
    client: Any = getattr(module, _CLIENTS[SCHEMES[scheme]])

    def connect() -> Transport:
        return client(url, cafile=cafile, verify=verify, auth_token=auth_token,  # type: ignore[no-any-return]
                      open_timeout=open_timeout, recv_timeout=recv_timeout)

    return connect


@dataclass(frozen=True)
class Listener:
    """A transport to serve on ``host``:``port`` (0: any free port); ``request_timeout``:
    seconds a client has to send a whole HTTP request or WebSocket handshake."""

    transport: str  # one of TRANSPORTS
    host: str
    port: int
    request_timeout: float = REQUEST_TIMEOUT
    allowed_origins: tuple[str, ...] = ()  # websocket: other pages' origins that may connect

    def url(self, port: int, tls: bool) -> str:
        scheme = {"websocket": "ws", "grpc": "grpc", "http": "http"}[self.transport]
        return f"{scheme}{'s' if tls else ''}://{self.host}:{port}"


async def serve(engine: CloudService, listeners: list[Listener], tls: tuple[str, str] | None = None,
                ready: Callable[[list[str]], None] | None = None,
                web: WebEdge | None = None) -> None:
    """Open every listener on this event loop and serve until cancelled; ``ready`` gets
    their URLs (with the ports they bound) once all are listening. ``tls``: the PEM
    certificate and key, for every listener; ``web``: what the WebSocket listener offers
    browsers (None: the page alone)."""
    urls: dict[int, str] = {}
    bound = asyncio.Event()
    tasks = []
    for i, listener in enumerate(listeners):
        if listener.transport not in TRANSPORTS:
            raise InputError(f"unknown transport {listener.transport!r}: use one of "
                             f"{', '.join(TRANSPORTS)}")
        module = importlib.import_module(f"spececd.transports.{listener.transport}")

        def on_ready(port: int, i: int = i, listener: Listener = listener) -> None:
            urls[i] = listener.url(port, tls is not None)
            if len(urls) == len(listeners):
                bound.set()

        extra: dict[str, Any] = {}
        if listener.transport == "websocket":
            extra = {"web": web, "origins": listener.allowed_origins}
        tasks.append(asyncio.ensure_future(
            module.serve(engine, listener.host, listener.port, tls, on_ready,
                         request_timeout=listener.request_timeout, **extra)))

    async def announce() -> None:
        await bound.wait()
        if ready is not None:
            ready([urls[i] for i in range(len(listeners))])

    tasks.append(asyncio.ensure_future(announce()))
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
