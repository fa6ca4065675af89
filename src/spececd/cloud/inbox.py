"""A link's incoming frames: what a transport's reader puts in, and what the service's loop
takes out, each frame with its arrival time (the stream loop measures the edge's
turnaround by it). Used on the service's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

_WAKE = (0.0, b"")  # put by Inbox.wake; told apart by identity


class Inbox:
    """Frames received on one link, in order, each with its arrival time; ``None`` marks
    the end of the link. Used on the service's event loop only."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._arrival = asyncio.Event()
        self._left = asyncio.Event()
        self.ended = False  # no more frames will come
        self.left = False  # and nobody reads the answers: the client is gone

    def wake(self) -> None:
        """Wake a :meth:`get` that waits (the service is draining); frames stay queued."""
        self._queue.put_nowait(_WAKE)
        self._arrival.set()

    def put(self, frame: bytes) -> None:
        """Queue a frame that arrived now (its arrival time is kept beside it)."""
        self._queue.put_nowait((time.perf_counter(), frame))
        self._arrival.set()

    def end(self) -> None:
        """No more frames will come (a gRPC client half-closed its stream, an HTTP link was
        closed): after the frames queued, :meth:`get` returns None."""
        if not self.ended:
            self.ended = True
            self._queue.put_nowait(None)
            self._arrival.set()

    def leave(self) -> None:
        """The client is gone (its connection closed): no more frames, and no answer will
        be read."""
        self.left = True
        self._left.set()
        self.end()

    async def gone(self) -> None:
        """Return once the client is gone (:meth:`leave`)."""
        await self._left.wait()

    async def arrived(self) -> None:
        """Return once something is queued (a frame, the end mark or a wake), taking
        nothing: a wait that is cancelled loses no frame."""
        while self._queue.empty():
            self._arrival.clear()
            await self._arrival.wait()

    async def get(self, timeout: float) -> bytes | None:
        """The next frame (None: the link ended); raises ``TimeoutError`` after ``timeout``."""
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:  # not TimeoutError itself before Python 3.11
            raise TimeoutError from None
        return None if item is None else item[1]  # _WAKE: b"", and the service is draining

    def poll(self) -> tuple[float, bytes] | None:
        """The next frame that has arrived and its arrival time, without waiting (None:
        none); the end mark stays for :meth:`get`."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is None:
                self._queue.put_nowait(None)
                return None
            if item is not _WAKE:
                return item
        return None

    async def wait(self, timeout: float) -> None:
        """Return once something is queued, or after ``timeout`` seconds."""
        if self._queue.empty() and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError before 3.11
                await asyncio.wait_for(self.arrived(), timeout)
