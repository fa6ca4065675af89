"""The built-in model runner: the target's backend in this process.

Model work runs on one worker thread, so the service's event loop stays free to read frames
(hints for a running generation among them), answer health checks and notice closed links
while a pass runs: the backend's own thread where it has one (transformers: the one thread
that runs every torch model of the process), else a thread of the runner's. Sessions'
verifications are batched into one forward pass by
:class:`~spececd.cloud.scheduler.BatchScheduler`. Each session has its own KV cache
(a :class:`~spececd.backends.base.CachedSequence`), allocated on first use and rebuilt from
the session's context after a failure or an eviction; with ``max_kv_bytes`` set, the least
recently used idle caches are freed to stay under it.

A generation's step is a verification of the hint ahead of the context (an empty draft
when there is none: one token of the target's own), built when the step starts.

A session with a constraint has a :class:`~spececd.grammar.ConstraintMatcher` here, beside
its cache, which every pass masks the target's logits with (see
:mod:`spececd.cloud.scheduler`); like the cache it is rebuilt from the context if lost.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor

from spececd.backends.base import Backend, CachedSequence
from spececd.cloud.metrics import Metrics
from spececd.cloud.runner import Generation, Pass
from spececd.cloud.scheduler import BatchScheduler
from spececd.core.sampling import Constraint, Mode, SamplingParams
from spececd.grammar import ConstraintMatcher, grammars_for
from spececd.protocol.cloud_session import CloudSession, StepOut, VerifyRequest

log = logging.getLogger(__name__)


class BuiltinRunner:
    """See the module docstring. ``max_kv_bytes``: KV cache bytes held across sessions at
    most (0: no cap)."""

    name = "builtin"

    def __init__(self, backend: Backend, metrics: Metrics, max_batch: int = 32,
                 max_kv_bytes: int = 0) -> None:
        self.backend = self.target = backend
        self.metrics = metrics
        self.max_kv_bytes = max_kv_bytes
        self._own_executor = backend.thread is None
        self.executor: Executor = backend.thread.executor if backend.thread is not None else \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="spececd-verify")
        self.scheduler = BatchScheduler(backend, self.executor, metrics, max_batch,
                                        inline=self._own_executor)
        self._caches: dict[str, CachedSequence] = {}
        self._matchers: dict[str, ConstraintMatcher] = {}
        self._busy: set[str] = set()  # sessions with a verification queued or running
        self._last_used: dict[str, float] = {}
        self.kv_evictions = 0

    def unsupported(self, mode: Mode, params: SamplingParams) -> str:
        return ""  # every mode and sampling setting

    async def verify(self, key: str, request: VerifyRequest) -> Pass:
        self._cap_kv(key, len(request.context) + len(request.tokens) + 1)
        sequence = self._caches.get(key)
        if sequence is None:  # first use, or evicted: rebuilt from the context
            sequence = self._caches[key] = self.backend.new_sequence()
        constraint = request.params.constraint
        matcher = None if constraint is None else self._matcher(key, constraint)
        self._busy.add(key)
        try:
            return await self.scheduler.verify(sequence, request, matcher)
        except BaseException:
            self._caches.pop(key, None)  # a failed pass may have left it half-updated
            self._matchers.pop(key, None)
            raise
        finally:
            self._busy.discard(key)
            self._last_used[key] = time.monotonic()

    def _matcher(self, key: str, constraint: Constraint) -> ConstraintMatcher:
        """``key``'s matcher for ``constraint`` (compiled when the hello was answered, so
        from the cache), new when the session's constraint changed."""
        matcher = self._matchers.get(key)
        if matcher is None or matcher.compiled.constraint != constraint:
            grammars = grammars_for(self.backend.tokenizer, self.backend.vocab_size)
            matcher = self._matchers[key] = grammars.compile(constraint).matcher()
        return matcher

    def generation(self, key: str, session: CloudSession) -> Generation:
        return _Steps(self, key, session)

    def _cap_kv(self, key: str, tokens_needed: int) -> None:
        """Free the KV caches of the least recently used idle sessions until the total,
        with ``tokens_needed`` more for ``key``, fits ``max_kv_bytes``. An evicted session
        keeps its place: its next pass re-prefills from its context."""
        cap, per_token = self.max_kv_bytes, self.backend.kv_bytes_per_token
        if not cap or not per_token:
            return
        total = (self.kv_tokens() - self.kv_tokens(key) + tokens_needed) * per_token
        idle = sorted((other for other in self._caches
                       if other != key and other not in self._busy),
                      key=lambda other: self._last_used.get(other, 0.0))
        for victim in idle:
            if total <= cap:
                break
            total -= self.kv_tokens(victim) * per_token
            del self._caches[victim]
            self.kv_evictions += 1
            self.metrics.kv_evictions.inc()
            log.info("evicted a KV cache", extra={"session": victim})

    def forget(self, key: str) -> None:
        self._caches.pop(key, None)
        self._matchers.pop(key, None)
        self._last_used.pop(key, None)

    def kv_tokens(self, key: str | None = None) -> int:
        """Tokens cached for session ``key``, or for all sessions (None)."""
        if key is not None:
            sequence = self._caches.get(key)
            return len(sequence.tokens) if sequence is not None else 0
        return sum(len(sequence.tokens) for sequence in list(self._caches.values()))

    def alive(self) -> bool:
        return True  # a failing pass fails its request; the runner goes on

    def status(self) -> dict[str, object]:
        return {"kv_evictions": self.kv_evictions}

    def close(self) -> None:
        self._caches.clear()
        self.scheduler.close()
        if self._own_executor:  # a backend's thread is the backend's, shared
            self.executor.shutdown(wait=False, cancel_futures=True)


class _Steps:
    """A generation on the built-in runner: each step verifies the hint as it stands when
    the step starts."""

    continuous = False

    def __init__(self, runner: BuiltinRunner, key: str, session: CloudSession) -> None:
        self._runner, self._key, self._session = runner, key, session

    async def step(self) -> StepOut:
        request = self._session.stream_step()
        done = await self._runner.verify(self._key, request)
        result = done.result
        return self._session.tokens(request, result.num_accepted, result.next_token,
                                    done.seconds, result.path, done.logprobs,
                                    done.prompt_logprobs)

    def hinted(self) -> None:
        pass  # read when the next step starts

    async def close(self) -> None:
        pass  # a step runs to its end; nothing else is held
