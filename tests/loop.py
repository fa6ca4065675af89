"""A server coroutine run as a task on an event loop of its own, in a background thread:
what the tests that talk to a real listener from synchronous code share."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class LoopTask:
    """``run()`` as a task on a new event loop in a daemon thread, until :meth:`stop`."""

    def __init__(self, run: Callable[[], Coroutine[Any, Any, object]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> asyncio.Task[object]:
            return asyncio.get_running_loop().create_task(run())

        self.task = asyncio.run_coroutine_threadsafe(start(), self.loop).result()

    def stop(self, after: Callable[[], Awaitable[None]] | None = None) -> None:
        """Cancel the task and wait for it, run ``after`` on the loop, end the thread."""
        async def stop() -> None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            if after is not None:
                await after()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
