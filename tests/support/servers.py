"""A server in this process for tests that talk to a real listener from synchronous code:
:class:`LoopTask` runs a coroutine on an event loop of its own in a background thread, and
:class:`ThreadServer` serves a cloud service on it through any of the networked
transports, as ``spececd serve`` does (:func:`spececd.transports.registry.serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any
from urllib.parse import urlsplit

from spececd.cloud.service import CloudService
from spececd.transports import registry


class LoopTask:
    """``run()`` as a task on a new event loop in a daemon thread, until :meth:`stop`."""

    def __init__(self, run: Callable[[], Coroutine[Any, Any, object]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> asyncio.Task[object]:
            return asyncio.get_running_loop().create_task(run())

        self.task = asyncio.run_coroutine_threadsafe(start(), self.loop).result()

    def call(self, function: Callable[[], Any]) -> Any:
        """``function()`` run on the loop (what the task serves is not thread-safe)."""
        async def run() -> Any:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

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


class ThreadServer:
    """``engine`` on 127.0.0.1 behind a listener of each of ``transports`` (``port``: 0
    for free ones), on an event loop in a background thread. ``urls``: each listener's
    URL by scheme; ``url``, ``port`` and ``target`` (``host:port``): the first's.
    :meth:`stop` closes the engine too, on its loop as the CLI does, unless
    ``close_engine`` is False."""

    def __init__(self, engine: CloudService, transports: Sequence[str] = ("http",), *,
                 port: int = 0, tls: tuple[str, str] | None = None,
                 request_timeout: float = registry.REQUEST_TIMEOUT,
                 allowed_origins: tuple[str, ...] = (), close_engine: bool = True) -> None:
        self.engine, self.close_engine = engine, close_engine
        bound = threading.Event()
        self.urls: dict[str, str] = {}

        def ready(urls: list[str]) -> None:
            self.urls = {url.split("://")[0]: url for url in urls}
            self.url = urls[0]
            bound.set()

        listeners = [registry.Listener(name, "127.0.0.1", port, request_timeout,
                                       allowed_origins) for name in transports]
        self.server = LoopTask(lambda: registry.serve(engine, listeners, tls, ready))
        while not bound.wait(0.05):
            if self.server.task.done():  # it failed to start: say why
                raise RuntimeError(f"the server did not start: {self.server.task!r}")

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, function: Callable[[], Any]) -> Any:
        """``function()`` run on the server's loop (the engine is not thread-safe)."""
        return self.server.call(function)

    def status(self) -> dict[str, Any]:
        return self.call(self.engine.status)  # type: ignore[no-any-return]

    def request(self, method: str, path: str, body: bytes | dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """One plain HTTP request to the first listener: (status, headers, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            headers = dict(headers or {})
            if isinstance(body, dict):
                body = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body, headers)
            response = conn.getresponse()
            headers = {k.lower(): v for k, v in response.getheaders()}
            return response.status, headers, response.read()
        finally:
            conn.close()

    def stop(self) -> None:
        async def close() -> None:
            if self.close_engine:
                self.engine.close()
                await asyncio.sleep(0.01)  # lets the tasks it cancelled finish

        self.server.stop(close)
