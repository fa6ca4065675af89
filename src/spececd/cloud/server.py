"""The verifier server's policy, independent of the transport: how many sessions, when an
idle one is evicted, where model work runs, what the status endpoint reports.

Model work (frame handling plus the target forward pass) runs on one worker thread, so an
asyncio transport's event loop stays free to accept connections, answer pings and notice
closed sockets while a verification runs. A connection that closes, by the client's
choice, a dropped link or an idle timeout, is released at once and its KV cache freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from spececd.cloud.scheduler import BatchScheduler
from spececd.cloud.verifier import Connection, VerifierService
from spececd.core.policy import Ema
from spececd.core.verify import VerifyResult
from spececd.protocol import messages as m
from spececd.protocol.errors import ServerBusy
from spececd.protocol.session import VerifyRequest

log = logging.getLogger(__name__)


class Inbox:
    """Frames received on one connection, in order, each with its arrival time; ``None``
    marks the end of the link. The transport puts, the server takes."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    def put(self, frame: bytes) -> None:
        self._queue.put_nowait((time.perf_counter(), frame))

    def end(self) -> None:
        self._queue.put_nowait(None)

    async def get(self, timeout: float) -> bytes | None:
        """The next frame (None: the link ended); raises ``TimeoutError`` after ``timeout``."""
        item = await asyncio.wait_for(self._queue.get(), timeout)
        return None if item is None else item[1]

    def poll(self) -> list[tuple[float, bytes]]:
        """The frames that have arrived, without waiting; the end mark stays for ``get``."""
        frames = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is None:
                self._queue.put_nowait(None)
                break
            frames.append(item)
        return frames

    async def wait(self, timeout: float) -> list[tuple[float, bytes]]:
        """Like :meth:`poll`, but first wait up to ``timeout`` seconds for a frame."""
        if self._queue.empty() and timeout > 0:
            with contextlib.suppress(TimeoutError):
                item = await asyncio.wait_for(self._queue.get(), timeout)
                if item is None:
                    self._queue.put_nowait(None)
                    return []
                return [item, *self.poll()]
        return self.poll()


@dataclass(frozen=True)
class ServerPolicy:
    max_sessions: int = 64
    idle_timeout: float = 300.0  # seconds without a frame before a session is evicted
    max_batch: int = 32  # sessions verified in one forward pass at most
    max_kv_bytes: int = 0  # KV cache bytes held across sessions at most (0: no cap)


class VerifierServer:
    def __init__(self, service: VerifierService, policy: ServerPolicy | None = None) -> None:
        self.service = service
        self.policy = policy or ServerPolicy()
        self.connections: set[Connection] = set()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spececd-verify")
        self.scheduler = BatchScheduler(self.executor, service.metrics, self.policy.max_batch)
        self.started = time.time()
        self.evicted = 0
        self.kv_evictions = 0
        self.errors: Counter[str] = Counter()  # by error code, of released sessions
        metrics = service.metrics
        metrics.active_sessions.set_function(lambda: len(self.connections))
        metrics.kv_bytes.set_function(lambda: self.kv_tokens() * self.kv_bytes_per_token)
        self.kv_bytes_per_token = getattr(service.backend, "kv_bytes_per_token", 0)

    def open(self) -> Connection | bytes:
        """A new connection, or the error frame to send when the server is full."""
        if len(self.connections) >= self.policy.max_sessions:
            error = ServerBusy(f"the server holds its maximum of {self.policy.max_sessions} "
                               f"sessions; try again later")
            return m.encode(m.Error(error.code, str(error), -1, True))
        connection = self.service.connect()
        self.connections.add(connection)
        log.info("session opened", extra={"session": connection.session.session_id,
                                          "sessions": len(self.connections)})
        return connection

    async def receive(self, connection: Connection, frame: bytes,
                      inbox: Inbox | None = None) -> AsyncIterator[bytes]:
        """The replies to ``frame``; model work goes through the batch scheduler.

        During a cloud-only generation the frames that arrive meanwhile are taken from
        ``inbox`` between steps: hints for it, or anything else, which is handled as usual
        and may end it. When the hint runs dry (the target contradicted it, or used it
        up), the next step waits for a fresh one if the edge has been answering faster
        than a step takes (measured: from the step that left no hint to the arrival of the
        next), and otherwise generates a token of its own without waiting."""
        out = connection.accept(frame)
        if out is None:
            return
        if isinstance(out, bytes):
            if out:
                yield out
            return
        if isinstance(out, VerifyRequest):
            result, seconds = await self._verify(connection, out)
            yield connection.verdict(out, result, seconds)
            return
        session = connection.session
        # The edge's answer to a dry hint, and a step without one.
        turnaround, step_s = Ema(0.0, weight=0.3), Ema(0.0, weight=0.3)
        dry_since: float | None = time.perf_counter()
        while session.stream is not None and session.stream.request is out:
            if inbox is not None:
                later = inbox.poll()
                if (not later and dry_since is not None and turnaround.seen and step_s.seen
                        and turnaround.value < step_s.value):
                    wait = dry_since + min(step_s.value, 1.5 * turnaround.value)
                    later = await inbox.wait(wait - time.perf_counter())
                for arrived, data in later:
                    async for reply in self.receive(connection, data, inbox):
                        yield reply
                    if session.stream is None or session.stream.request is not out:
                        return  # closed, or replaced by a new hello, generate or draft
                    if dry_since is not None and session.hint_ahead():
                        turnaround.update(arrived - dry_since)
                        dry_since = None
            request = session.stream_step()
            result, seconds = await self._verify(connection, request)
            if not request.tokens:
                step_s.update(seconds)
            yield connection.generated(request, result, seconds)[0]
            if dry_since is None and not session.hint_ahead():
                dry_since = time.perf_counter()

    async def _verify(self, connection: Connection, request: VerifyRequest
                      ) -> tuple[VerifyResult, float]:
        self._cap_kv(connection, len(request.context) + len(request.tokens) + 1)
        if connection.sequence is None:  # evicted: rebuilt from the session's context
            connection.sequence = self.service.backend.new_sequence()
        connection.busy = True
        try:
            result, seconds, _ = await self.scheduler.verify(connection, request)
        finally:
            connection.busy = False
            connection.last_used = time.monotonic()
        return result, seconds

    def _cap_kv(self, connection: Connection, tokens_needed: int) -> None:
        """Free the KV caches of the least recently used idle sessions until the total,
        with ``tokens_needed`` more for ``connection``, fits ``max_kv_bytes``. An evicted
        session keeps its place: its next round re-prefills from its context."""
        cap, per_token = self.policy.max_kv_bytes, self.kv_bytes_per_token
        if not cap or not per_token:
            return
        total = (self.kv_tokens() - connection.kv_tokens + tokens_needed) * per_token
        idle = sorted((c for c in self.connections
                       if c is not connection and not c.busy and c.sequence is not None),
                      key=lambda c: c.last_used)
        for victim in idle:
            if total <= cap:
                break
            total -= victim.kv_tokens * per_token
            victim.sequence = None
            self.kv_evictions += 1
            self.service.metrics.kv_evictions.inc()
            log.info("evicted a KV cache", extra={"session": victim.session.session_id})

    def release(self, connection: Connection, idle: bool = False) -> None:
        connection.close()
        if connection in self.connections:
            self.connections.discard(connection)
            self.errors.update(connection.session.errors)
            log.info("session closed", extra={
                "session": connection.session.session_id, "idle_evicted": idle,
                "errors": dict(connection.session.errors), "sessions": len(self.connections)})
        if idle:
            self.evicted += 1

    def kv_tokens(self) -> int:
        return sum(c.kv_tokens for c in list(self.connections))

    def ready(self) -> bool:
        return len(self.connections) < self.policy.max_sessions

    def status(self) -> dict[str, object]:
        return {
            "sessions": len(self.connections),
            "max_sessions": self.policy.max_sessions,
            "kv_tokens": self.kv_tokens(),
            "kv_bytes": self.kv_tokens() * self.kv_bytes_per_token,
            "kv_bytes_by_session": {c.session.session_id: c.kv_tokens * self.kv_bytes_per_token
                                    for c in list(self.connections)},
            "evicted_idle": self.evicted,
            "kv_evictions": self.kv_evictions,
            "errors": dict(sum((c.session.errors for c in self.connections), self.errors)),
            "uptime_s": round(time.time() - self.started, 1),
            "model": getattr(self.service.backend, "description", self.service.backend.name),
        }

    def shutdown(self) -> None:
        for connection in list(self.connections):
            self.release(connection)
        self.scheduler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
