"""A userspace network-latency emulator: a TCP proxy that delays every byte.

``DelayProxy`` listens on loopback and forwards each connection to a target address,
delivering every chunk ``delay_ms`` (plus uniform jitter up to ``jitter_ms``) after it
arrived, in order, in each direction. Real packets cross real sockets, so an edge talking
to a server through it sees a round trip of about ``2 * delay_ms`` on top of the
loopback's. ``TCP_NODELAY`` is set on both legs: Nagle's algorithm would otherwise add
its own delays.

Where the kernel has ``netem`` (not on these machines), the same effect on a real
interface, for users who prefer it::

    tc qdisc add dev eth0 root netem delay 20ms 2ms    # 20 ms one way, 2 ms jitter
    tc qdisc del dev eth0 root                          # remove it

(on one machine, use ``dev lo``: every loopback packet is then delayed, in both
directions, so the round trip grows by twice the delay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import threading
import time

log = logging.getLogger(__name__)


class DelayProxy:
    def __init__(self, target_host: str, target_port: int, delay_ms: float,
                 jitter_ms: float = 0.0, seed: int = 0, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        if delay_ms < 0 or jitter_ms < 0:
            raise ValueError("delay and jitter must be >= 0")
        self.target = (target_host, target_port)
        self.delay = delay_ms / 1000
        self.jitter = jitter_ms / 1000
        self.listen = (listen_host, listen_port)
        self.port = 0
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- forwarding -------------------------------------------------------------------
    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        last_due = 0.0
        try:
            while data := await reader.read(65536):
                due = time.monotonic() + self.delay + self._rng.uniform(0, self.jitter)
                last_due = max(last_due, due)  # jitter never reorders a byte stream
                queue.put_nowait((last_due, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((last_due, b""))
            with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                await sender
            sender.cancel()
            writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        for w in (client_writer, upstream_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(asyncio.CancelledError):
            # Cancelled when the proxy stops. Ending quietly keeps CPython 3.11's
            # start_server from logging the cancelled handler as an error.
            await asyncio.gather(self._pump(client_reader, upstream_writer),
                                 self._pump(upstream_reader, client_writer))

    async def run(self, started: threading.Event | None = None) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, *self.listen)
        self.port = server.sockets[0].getsockname()[1]
        if started is not None:
            started.set()
        async with server:
            await self._stop.wait()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- in a background thread -------------------------------------------------------
    def start(self) -> DelayProxy:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self.run(started),), daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("delay proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
