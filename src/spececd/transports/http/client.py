"""The edge's HTTP transport: :class:`HttpTransport`, blocking, on ``http.client``.

It speaks the frame links of :mod:`spececd.transports.http.links` over one kept-alive
connection (see the class for how hints avoid waiting and how retries stay idempotent).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import select
import socket
import time
from collections import deque
from dataclasses import dataclass
from email.message import Message
from typing import Any
from urllib.parse import urlsplit

from spececd.edge.transport import AFFINITY_HEADER, affinity_key
from spececd.protocol import messages as m
from spececd.protocol.errors import (
    AuthFailed,
    EngineFailed,
    LimitExceeded,
    ProtocolError,
    ServerBusy,
    error_for_code,
)
from spececd.transports.http.links import FIRST_REPLY, MAX_WAIT
from spececd.transports.tls import client_ssl_context


@dataclass
class _Request:
    method: str
    target: str
    body: bytes | None
    timeout: float
    frame: bool = False  # a frame POST: a 200 means the server has the frame
    fresh: bool = True  # written on a connection that had answered nothing before


class _Metered:
    """A connected socket that counts the bytes ``http.client`` writes and reads."""

    def __init__(self, sock: socket.socket, owner: HttpTransport) -> None:
        self._sock, self._owner = sock, owner

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        self._owner.bytes_sent += len(data)

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_MeteredReader(self._sock.makefile("rb", buffering=0),
                                                self._owner))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _MeteredReader(io.RawIOBase):
    def __init__(self, raw: Any, owner: HttpTransport) -> None:
        self._raw, self._owner = raw, owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        n: int | None = self._raw.readinto(buffer)
        self._owner.bytes_received += n or 0
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def frame_type(frame: bytes) -> int:
    """A frame's message type, read without decoding it: every frame is a msgpack array
    of under 16 items (a one-byte header) whose first item, the type, is a small int."""
    return frame[1] if len(frame) > 1 and 0x90 <= frame[0] <= 0x9F else -1


def unpack_replies(body: bytes) -> list[bytes]:
    """The frames of a response body: each a 4-byte big-endian length, then the frame."""
    replies, i = [], 0
    while i < len(body):
        n = int.from_bytes(body[i:i + 4], "big")
        if i + 4 + n > len(body):
            raise ValueError("a truncated reply")
        replies.append(body[i + 4:i + 4 + n])
        i += 4 + n
    return replies


CLOSE_TIMEOUT = 2.0  # seconds close() spends telling the server, at most
_DELIVERED = (AuthFailed.code, ServerBusy.code, LimitExceeded.code, EngineFailed.code)


class HttpTransport:
    """A blocking client link to a verifier over HTTP/1.1, for ``http://`` and ``https://``
    URLs (a path in the URL is kept as a prefix, for a server behind a proxy).

    One keep-alive connection carries everything. A frame that expects an answer (hello,
    draft, generate) is POSTed with a wait, so its reply comes back in the same exchange.
    A hint or a close is written and its response read later, by the next call or by
    :meth:`poll` once it has arrived, so sending one never waits for the network. No
    second connection is needed: the edge loop blocks in :meth:`recv` only when it has
    nothing to send, so a long-poll is never outstanding while it wants to send.

    Frames are numbered and replies acknowledged, so when a kept-alive connection turns
    out to be closed by the server the request is written once more on a new one. Every
    other failure (refused, reset, timed out, the link unknown or ended) raises
    ``ConnectionError``: the edge opens a new link and re-sends its history. The server's
    own refusals the WebSocket server would answer with an error frame (auth, busy, a
    frame over the size limit) arrive as that error frame.

    The link is opened by the first frame sent, authorized by ``auth_token`` or, without
    one, by the token in that frame when it is a hello (what the edge sends first).

    ``bytes_sent`` and ``bytes_received`` count the HTTP bytes written to and read from
    the connection: request and status lines, headers and bodies (under TLS, the bytes
    inside it; TCP/IP and TLS overhead are not counted).
    """

    def __init__(self, url: str, *, auth_token: str = "", cafile: str | None = None,
                 verify: bool = True, open_timeout: float = 10.0,
                 recv_timeout: float = 120.0) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise ValueError(f"bad server URL {url!r}: use http://host:port or "
                             f"https://host:port")
        self.url = url
        self.open_timeout, self.recv_timeout = open_timeout, recv_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        self._host = parts.hostname
        self._port = port or (443 if parts.scheme == "https" else 80)
        self._context = client_ssl_context(cafile, verify) if parts.scheme == "https" else None
        self._token = auth_token
        self._headers: dict[str, str] = {}
        self._conn: http.client.HTTPConnection | None = None
        self._answered = 0  # responses read on this connection
        self._inflight: _Request | None = None  # written, its response not read yet
        self._replies: deque[bytes] = deque()
        self._frames = 0  # frames the server has: the next one's number
        self._acked = 0  # replies received: the next one's number
        self._links = parts.path.rstrip("/") + "/v1/links"
        self._link: str | None = None  # the link's path, once open
        self._ended = False  # the link ended or was refused
        self._connection()  # now, so that an unreachable server or a bad certificate fails here

    def _open(self, frame: bytes | None) -> None:
        """Open the link, authorized by the token given, else by the one in ``frame`` when
        it is a hello (the edge's credentials travel there; the server wants them first)."""
        token = self._token
        if not token and frame is not None and frame_type(frame) == m.Hello.TYPE:
            with contextlib.suppress(ProtocolError):  # a malformed hello carries none
                hello = m.decode(frame)
                token = hello.auth_token if isinstance(hello, m.Hello) else ""
        # The key pins every request of this link to one replica behind a balancer.
        self._headers = {AFFINITY_HEADER: affinity_key(),
                         **({"Authorization": f"Bearer {token}"} if token else {})}
        status, _, body = self._exchange(_Request("POST", self._links, b"", self.open_timeout))
        if status != 201:
            self._refused(status, body)
            self._ended = True
            return
        try:
            self._link = f"{self._links}/{json.loads(body)['link_id']}"
        except (ValueError, KeyError, TypeError) as exc:
            raise ConnectionError(f"{self.url} is not a SpecECD server ({exc})") from None

    # -- the Transport protocol ---------------------------------------------------------
    def send(self, frame: bytes) -> None:
        self._settle()
        if self._link is None and not self._ended:
            self._open(frame)
        if self._link is None:
            if self._replies:
                return  # a refusal waits to be read; like a closing WebSocket, drop this
            raise ConnectionError(f"the link to {self.url} has ended")
        quiet = frame_type(frame) in (m.Hint.TYPE, m.Close.TYPE)  # nothing to wait for
        wait = 0.0 if quiet else min(self.recv_timeout, MAX_WAIT)
        request = _Request("POST", f"{self._link}/frames?n={self._frames}&ack={self._acked}"
                                   f"&wait={wait:g}", frame, wait + self.open_timeout, True)
        self._write(request)
        if quiet:
            self._inflight = request
        else:
            self._take(request, *self._finish(request))

    def recv(self) -> bytes:
        if self._link is None and not self._ended:
            self._open(None)
        deadline = time.monotonic() + self.recv_timeout
        while not self._replies:
            if self._inflight is not None:
                self._settle()
                continue
            if self._link is None:
                raise ConnectionError(f"the link to {self.url} has ended")
            wait = min(deadline - time.monotonic(), MAX_WAIT)
            if wait <= 0:
                raise ConnectionError(f"{self.url} sent nothing in {self.recv_timeout:g} s")
            request = _Request("GET", f"{self._link}/frames?ack={self._acked}&wait={wait:.3f}",
                               None, wait + self.open_timeout)
            self._take(request, *self._exchange(request))
        return self._replies.popleft()

    def poll(self) -> bytes | None:
        """A reply that has already arrived, or None; never waits for one."""
        if not self._replies and self._inflight is not None and self._arrived():
            self._settle()
        if self._replies:
            return self._replies.popleft()
        if self._ended and self._inflight is None:
            raise ConnectionError(f"the link to {self.url} has ended")
        return None

    def close(self) -> None:
        """End the link on the server (briefly: the server ends it anyway when idle)."""
        link, self._link, self._ended = self._link, None, True
        self.open_timeout = min(self.open_timeout, CLOSE_TIMEOUT)
        with contextlib.suppress(Exception):  # closing a broken link must not raise
            if link is not None:
                if self._inflight is not None:
                    self._inflight.timeout = CLOSE_TIMEOUT
                    self._settle()
                self._exchange(_Request("DELETE", link, None, CLOSE_TIMEOUT))
        self._disconnect()

    # -- requests -----------------------------------------------------------------------
    def _exchange(self, request: _Request) -> tuple[int, Message, bytes]:
        self._write(request)
        return self._finish(request)

    def _write(self, request: _Request) -> None:
        while True:
            conn = self._connection()
            request.fresh = self._answered == 0
            try:
                conn.sock.settimeout(request.timeout)
                # By hand, to leave out Accept-Encoding: 26 bytes a round for nothing.
                conn.putrequest(request.method, request.target, skip_accept_encoding=True)
                for name, value in self._headers.items():
                    conn.putheader(name, value)
                if request.body is not None:
                    conn.putheader("Content-Length", str(len(request.body)))
                conn.endheaders(request.body)
                return
            except (OSError, http.client.HTTPException) as exc:
                self._disconnect()
                if request.fresh:
                    raise ConnectionError(f"connection to {self.url} lost: {exc}") from exc

    def _finish(self, request: _Request) -> tuple[int, Message, bytes]:
        """Read the response to ``request``; when the server had closed the kept-alive
        connection it went on, write it once more on a new one (it is idempotent)."""
        while True:
            assert self._conn is not None
            try:
                self._conn.sock.settimeout(request.timeout)
                response = self._conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self._disconnect()
                if request.fresh or isinstance(exc, TimeoutError):
                    raise ConnectionError(f"connection to {self.url} lost: {exc}") from exc
                self._write(request)
                continue
            self._answered += 1
            return response.status, response.msg, body

    def _settle(self) -> None:
        """Read the response to a hint or close still in flight."""
        request, self._inflight = self._inflight, None
        if request is not None:
            self._take(request, *self._finish(request))

    def _take(self, request: _Request, status: int, headers: Message, body: bytes) -> None:
        if status != 200:
            self._refused(status, body)
            return
        try:
            first = int(headers.get(FIRST_REPLY, ""))
            replies = unpack_replies(body)
        except ValueError as exc:
            raise ConnectionError(f"{self.url} sent a malformed response: {exc}") from None
        if first > self._acked:
            raise ConnectionError(f"{self.url} lost replies {self._acked} to {first - 1}")
        if request.frame:
            self._frames += 1
        self._replies.extend(replies[self._acked - first:])
        self._acked = max(self._acked, first + len(replies))

    def _refused(self, status: int, body: bytes) -> None:
        """An error answer: the error frame the session would have sent, for the refusals
        a WebSocket server answers with one; else ``ConnectionError``."""
        try:
            error = json.loads(body)["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "", body[:200].decode(errors="replace")
        if code not in _DELIVERED:
            raise ConnectionError(f"{self.url} answered {status} {code}: {message}")
        fatal = error_for_code(code, message).fatal
        self._replies.append(m.encode(m.Error(code, message, -1, fatal)))
        if fatal:
            self._link, self._ended = None, True

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is not None and self._conn.sock is not None:
            return self._conn
        conn = (http.client.HTTPSConnection(self._host, self._port, timeout=self.open_timeout,
                                            context=self._context)
                if self._context is not None else
                http.client.HTTPConnection(self._host, self._port, timeout=self.open_timeout))
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            raise ConnectionError(f"cannot connect to {self.url}: {exc}") from exc
        conn.sock = _Metered(conn.sock, self)
        self._conn, self._answered = conn, 0
        return conn

    def _arrived(self) -> bool:
        sock = self._conn.sock if self._conn is not None else None
        if sock is None:
            return True  # let _settle find out
        pending = getattr(sock, "pending", None)  # bytes TLS has decrypted already
        return bool(pending and pending()) or bool(select.select([sock], [], [], 0)[0])

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None
