"""A deadline on reading each HTTP request: the slowloris guard of every HTTP listener (the
HTTP transport's and ``spececd api``'s).

uvicorn's HTTP/1.1 protocol closes idle keep-alive connections, but not one whose client
sends its request slowly: one byte a second holds a connection, and what it buffered, for
as long as the client likes. :func:`protocol` gives uvicorn a subclass that arms a timer
when a request begins (the connection opens, or the next request's first byte arrives)
and disarms it once the whole request, head and body, has been read. A request still
unread when it fires is answered ``408`` with an error body in OpenAI's shape, which holds
SpecECD's too (``{"error": {"message", "type", "param", "code"}}``, code
``request_timeout``), and the connection is closed. A response the application began
before the body was complete (a 413 for a body over the limit) is left to finish.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from spececd.errors import InputError


def timeout_body(seconds: float) -> bytes:
    """The 408's body."""
    return json.dumps({"error": {
        "message": f"the request was not received within {seconds:g} s (the server's "
                   f"request timeout): send the whole request, head and body, at once",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()


class _DeadlineProtocol(HttpToolsProtocol):
    request_timeout = 10.0  # seconds; set by protocol()
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:
            self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            return  # the application answered before the body was complete: let it finish
        body = timeout_body(self.request_timeout)
        self.transport.write(b"".join((
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n",
            body)))
        self.transport.close()


def protocol(request_timeout: float) -> type[Any]:
    """uvicorn's HTTP/1.1 protocol (httptools) with a ``request_timeout`` (seconds) on
    reading each request."""
    if request_timeout <= 0:
        raise InputError(f"the request timeout must be > 0 seconds, got {request_timeout}")
    return type("DeadlineProtocol", (_DeadlineProtocol,), {"request_timeout": request_timeout})
