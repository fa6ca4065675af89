"""The HTTP server: frame links, JSON sessions and the operators' endpoints on one port.

:func:`create_app` builds the FastAPI app for an engine (its OpenAPI schema describes every
endpoint); :func:`serve` runs it with uvicorn on the caller's event loop until cancelled.
Plain HTTP next to the API, as on the WebSocket server: the operators' endpoints of
:mod:`spececd.transports.ops` (health, readiness, status, metrics, the tokenizer); these
need no token.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Response

from spececd.cloud.service import CloudService
from spececd.protocol import messages as m
from spececd.transports import ops
from spececd.transports.http import links, sessions
from spececd.transports.http.common import BodyLimit, EngineDep, answer_errors, without_422
from spececd.transports.http.deadline import protocol
from spececd.transports.registry import REQUEST_TIMEOUT
from spececd.transports.tls import server_ssl_context

KEEP_ALIVE = 75  # seconds the server keeps an idle connection open

def _route(endpoint: ops.Endpoint) -> Callable[[CloudService], Awaitable[Response]]:
    async def route(engine: EngineDep) -> Response:
        reply = endpoint.answer(engine)
        return Response(reply.body, reply.status, media_type=reply.content_type)

    return route


def _ops_router() -> APIRouter:
    """The operators' endpoints (:mod:`spececd.transports.ops`) as routes."""
    router = APIRouter(tags=["operations"])
    for endpoint in ops.ENDPOINTS:
        failure: dict[int | str, dict[str, Any]] | None = (
            {endpoint.failure_status: {"description": endpoint.failure}}
            if endpoint.failure else None)
        router.add_api_route(endpoint.path, _route(endpoint), methods=["GET"],
                             name=endpoint.name, description=endpoint.summary,
                             response_class=Response, responses=failure)
    return router


def create_app(engine: CloudService) -> FastAPI:
    app = FastAPI(title="SpecECD verifier", version=str(m.PROTOCOL_VERSION),
                  summary="Lossless speculative decoding: the cloud's verifier", redoc_url=None)
    app.state.engine = engine
    app.state.links = links.Links(engine)
    app.state.sessions = sessions.Sessions(engine)
    for router in (links.router, sessions.router, _ops_router()):
        app.include_router(router)
    app.add_middleware(BodyLimit, limit=engine.limits.max_message_bytes, engine=engine)
    answer_errors(app, engine)
    without_422(app)
    return app


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose protocol is named (``IPPROTO_TCP``, as getaddrinfo
    gives it), so that asyncio sets ``TCP_NODELAY`` on the connections it accepts. Without
    it (``socket.create_server`` leaves the protocol 0) a response's headers and body,
    written apart, wait about 40 ms for the client's delayed ACK."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the caller's event loop owns the signals: cancel serve() to stop


async def serve(engine: CloudService, host: str, port: int,
                tls: tuple[str, str] | ssl.SSLContext | None = None,
                ready: Callable[[int], None] | None = None,
                request_timeout: float = REQUEST_TIMEOUT) -> None:
    """Serve until cancelled. ``tls``: PEM certificate and key, or a server SSL context
    (https://); ``ready`` gets the port bound (``port`` 0: any free one). A port that
    cannot be bound raises ``OSError``. The caller closes the engine."""
    app = create_app(engine)

    def stopping() -> None:
        app.state.links.close_all()  # ends every link: its long polls answer at once
        app.state.sessions.close_all()

    await serve_app(app, host, port, tls, ready, stopping, request_timeout)


async def serve_app(app: FastAPI, host: str, port: int,
                    tls: tuple[str, str] | ssl.SSLContext | None = None,
                    ready: Callable[[int], None] | None = None,
                    stopping: Callable[[], None] | None = None,
                    request_timeout: float = REQUEST_TIMEOUT) -> None:
    """Run ``app`` with uvicorn on the caller's event loop until cancelled; ``stopping``
    runs first when it is (long requests end before uvicorn waits for them). A request not
    read whole within ``request_timeout`` seconds is answered 408 (:mod:`.deadline`)."""
    ssl_context = server_ssl_context(*tls) if isinstance(tls, tuple) else tls
    config = uvicorn.Config(
        app, lifespan="off", ws="none", log_config=None, access_log=False,
        http=protocol(request_timeout),
        server_header=False, date_header=False, timeout_keep_alive=KEEP_ALIVE,
        timeout_graceful_shutdown=2,
        ssl_context_factory=(lambda _config, _default: ssl_context) if ssl_context else None)
    server = _Server(config)
    sock = listen(host, port)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        if task.done():
            task.result()
        if ready is not None:
            ready(sock.getsockname()[1])
        await asyncio.shield(task)
    finally:
        if stopping is not None:
            stopping()
        server.should_exit = True
        await task
        sock.close()
