"""A slowloris client, for the listeners' request-timeout tests: a request one byte a second."""

from __future__ import annotations

import contextlib
import socket
import time


def trickle(port: int, data: bytes, limit: float, lead: bytes = b"") -> tuple[float, bytes]:
    """Send ``lead`` at once, then ``data`` one byte a second for at most ``limit`` seconds;
    return the seconds from the first trickled byte until the server answered or closed (or
    the limit), and all it answered (b"" when it closed without a word)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=limit + 5)
    sock.sendall(lead)
    started, answer = time.monotonic(), b""
    with contextlib.suppress(OSError):  # the server may close it mid-send
        for byte in data:
            if time.monotonic() - started > limit:
                break
            sock.sendall(bytes([byte]))
            time.sleep(1.0)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                chunk = sock.recv(65536)
                if not chunk:
                    break  # closed
                answer += chunk
            sock.setblocking(True)
            if answer:
                break
    took = time.monotonic() - started
    if answer:  # the rest of the answer, up to the server's close
        sock.settimeout(2)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    sock.close()
    return took, answer
