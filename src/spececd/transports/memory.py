"""In-memory transport: the edge talks to a verifier engine in the same process, through
the same frames, session state machines and engine loop as over a network.

:class:`LocalServer` runs an :class:`~spececd.cloud.service.CloudService` on its own event loop in
a background thread; each :class:`MemoryTransport` is one link to it. So in-process
generation batches concurrent sessions and stream-drafts exactly like a networked one:
the engine reads hints while the target works. (Where draft and target are both
transformers models on several torch threads they share the one thread torch runs on in a
process, :func:`~spececd.backends.hf.torch_thread`, so a draft step and a verify pass take
turns; on one torch thread each, as the CLI runs them on two cores, each has its own and
they overlap: :func:`~spececd.backends.hf.model_thread`.)
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

from spececd.backends.base import Backend
from spececd.cloud.runners import builtin_service
from spececd.cloud.service import CloudService, Link, ServicePolicy
from spececd.protocol.cloud_session import Limits


class LocalServer:
    """An engine on a background event loop. Calling it opens a new link (a
    :class:`~spececd.edge.transport.Transport` factory, like a server URL)."""

    def __init__(self, engine: CloudService) -> None:
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="spececd-engine")
        self._thread.start()

    def __call__(self) -> MemoryTransport:
        return MemoryTransport(self)

    def open(self, replies: queue.SimpleQueue[bytes | None]) -> Link:
        """Open a link and serve it on the loop; its replies, then None, go to ``replies``."""

        async def send(frame: bytes) -> None:
            replies.put(frame)

        async def start() -> Link:
            link = self.engine.open()

            async def run() -> None:
                try:
                    await self.engine.serve(link, send)
                finally:
                    replies.put(None)

            self._loop.create_task(run())
            return link

        return asyncio.run_coroutine_threadsafe(start(), self._loop).result()

    def call(self, function: Callable[..., object], *args: object) -> None:
        """Run ``function(*args)`` on the engine's loop."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(function, *args)

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def stop() -> None:
            self.engine.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class MemoryTransport:
    def __init__(self, server: LocalServer, recv_timeout: float = 600.0) -> None:
        self._server = server
        self._replies: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._link = server.open(self._replies)
        self._ended = False
        self.recv_timeout = recv_timeout
        self.bytes_sent = 0
        self.bytes_received = 0

    def send(self, frame: bytes) -> None:
        if self._ended:
            raise ConnectionError("the in-process verifier closed this link")
        self.bytes_sent += len(frame)
        self._server.call(self._link.put, frame)

    def recv(self) -> bytes:
        try:
            frame = self._replies.get(timeout=self.recv_timeout)
        except queue.Empty:
            raise ConnectionError("the in-process verifier sent nothing back in "
                                  f"{self.recv_timeout:.0f} s") from None
        return self._received(frame)

    def poll(self) -> bytes | None:
        try:
            frame = self._replies.get_nowait()
        except queue.Empty:
            return None
        return self._received(frame)

    def _received(self, frame: bytes | None) -> bytes:
        if frame is None:
            self._ended = True
            raise ConnectionError("the in-process verifier closed this link")
        self.bytes_received += len(frame)
        return frame

    def close(self) -> None:
        self._server.call(self._link.end)


def local_verifier(backend: Backend, limits: Limits | None = None,
                   policy: ServicePolicy | None = None) -> LocalServer:
    """A verifier for ``backend`` in this process; each call of the result opens a new
    link to it."""
    return LocalServer(builtin_service(backend, limits, policy))
