"""Batched verification across sessions: continuous batching with no timer.

Sessions submit verification work (a draft to verify, or one step of a cloud-only
generation, which is a verification of an empty draft). One worker takes *everything*
queued, up to ``max_batch``, and runs it as one batched target forward pass on the model
thread; whatever arrives meanwhile forms the next batch. So the batching window is the
duration of the pass before it: a lone client never waits for a timer, and under load the
batch grows by itself. Each session keeps its own KV cache; a batch pads them together for
the pass and hands each its own back (``Backend.extend_batch``).

Batching changes nothing but floating-point rounding: every session's tokens, RNG stream
and acceptance decisions are its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor

from spececd.cloud.metrics import Metrics
from spececd.cloud.verifier import Connection, run_verifications
from spececd.core.verify import VerifyResult
from spececd.protocol.session import VerifyRequest

log = logging.getLogger(__name__)

Job = tuple[Connection, VerifyRequest, "asyncio.Future[tuple[VerifyResult, float, int]]"]


class BatchScheduler:
    def __init__(self, executor: Executor, metrics: Metrics, max_batch: int = 32) -> None:
        self.executor = executor
        self.metrics = metrics
        self.max_batch = max_batch
        self._queue: list[Job] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def verify(self, connection: Connection, request: VerifyRequest
                     ) -> tuple[VerifyResult, float, int]:
        """Run ``request`` in the next batch; return its result, the pass's duration and the
        batch size."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        future: asyncio.Future[tuple[VerifyResult, float, int]] = (
            asyncio.get_running_loop().create_future())
        self._queue.append((connection, request, future))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                for job in batch:  # a session that closed while queued has no cache left
                    if job[0].sequence is None and not job[2].done():
                        job[2].set_exception(ConnectionError("session closed"))
                batch = [job for job in batch if not job[2].done()]
                if batch:
                    await self._pass(batch)

    async def _pass(self, batch: list[Job]) -> None:
        """One batched forward pass; if it fails, each job alone, so that one bad request
        fails only itself."""
        loop = asyncio.get_running_loop()
        backend = batch[0][0].service.backend
        start = time.perf_counter()
        try:
            results = await loop.run_in_executor(
                self.executor, run_verifications, backend,
                [(c.sequence, r) for c, r, _ in batch])
        except Exception:
            if len(batch) == 1:
                batch[0][2].set_exception(RuntimeError("verification failed"))
                log.exception("verification failed")
                return
            log.exception("batched verification failed; retrying one by one")
            for job in batch:
                await self._pass([job])
            return
        seconds = time.perf_counter() - start
        self.metrics.batch_size.observe(len(batch))
        for (_, _, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result((result, seconds, len(batch)))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
