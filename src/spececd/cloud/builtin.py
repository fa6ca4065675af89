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

It has no generation of its own: the service steps a cloud-only generation by verifying
the hint ahead of the context (an empty draft when there is none: one token of the
target's own), built when the step starts.

Under load each pass is held to the token budget (``config.token_budget``; see
:mod:`spececd.cloud.scheduler`). Each session's acceptance by depth is kept here beside its
cache, shrunk toward its draft source's over every session (a model's draft with its
probabilities, a draft of token ids alone, a tree), so that the scheduler knows what each
session's positions are worth.

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
from spececd.cloud.runner import Generation, Pass, RunnerConfig
from spececd.cloud.scheduler import BatchScheduler
from spececd.core.budget import DepthAcceptance
from spececd.core.params import Constraint, Mode, SamplingParams
from spececd.errors import InputError
from spececd.grammar import ConstraintMatcher, grammars_for
from spececd.protocol.cloud_session import GenerateRequest, Limits, VerifyRequest

log = logging.getLogger(__name__)


def start(model: str, config: RunnerConfig, limits: Limits, metrics: Metrics) -> BuiltinRunner:
    """Load ``model`` on its backend (:func:`~spececd.backends.registry.load_backend`) as
    ``config`` says, and run it here."""
    from spececd.backends.registry import load_backend

    backend = load_backend(model, device=config.device, dtype=config.dtype,
                           threads=config.threads, npu=config.npu)
    return BuiltinRunner(runner_path(backend, config, limits.max_context), metrics, config)


STATIC = ("auto", "on", "off")


def runner_path(backend: Backend, config: RunnerConfig, max_context: int) -> Backend:
    """``backend`` as the built-in runner runs it. A transformers model whose every layer
    attends to the whole context: on the packed, paged path (:mod:`spececd.backends.paged`,
    its pool of ``config.max_kv_bytes``), on fixed shapes replayed from CUDA graphs where
    ``config.static`` says (``on``; ``auto`` on CUDA only); another (sliding windows) as it
    is, a batch item by item. Any other runtime as it is."""
    static = config.static
    if static not in STATIC:
        raise InputError(f"static must be one of {', '.join(STATIC)}, got {static!r}")
    if backend.name == "hf":  # torch and transformers are installed
        from spececd.backends.hf import HFBackend

        if isinstance(backend, HFBackend) and backend.full_attention:
            from spececd.backends.paged import PagedBackend

            fixed = static == "on" or (static == "auto" and backend.device.type == "cuda")
            return PagedBackend(backend, max_context, pool_pages(
                config, backend.kv_bytes_per_token, PagedBackend.kv_block), fixed=fixed)
        if isinstance(backend, HFBackend) and static == "on":
            raise InputError("fixed shapes (--static on) run models whose every layer "
                             "attends to the whole context, and this one has sliding "
                             "windows: leave --static at auto or off")
        return backend
    if static == "on":
        raise InputError(f"the static path runs transformers models only, and this target "
                         f"runs on {backend.name}: leave --static at auto or off")
    return backend


def pool_pages(config: RunnerConfig, kv_bytes_per_token: int, page: int) -> int:
    """The pages of ``page`` tokens a capped KV pool holds (0: ``config.max_kv_bytes`` is
    0, no cap): ``max_kv_bytes`` of them, which the runner keeps the sessions' caches
    within between passes by evicting idle ones, and the pages one pass may add beside
    them (its ``max_batched_tokens`` new positions, and a page begun by each of its
    ``max_batch`` rows; with no cap on a pass's positions, as many as the cap again)."""
    if not config.max_kv_bytes:
        return 0
    held = config.max_kv_bytes // (page * kv_bytes_per_token)
    added = -(-config.max_batched_tokens // page) if config.max_batched_tokens else held
    return max(1, held) + added + config.max_batch


class BuiltinRunner:
    """See the module docstring; of ``config``, it reads ``max_batch``, ``max_kv_bytes``
    (the KV cache bytes held across sessions at most, 0: no cap), ``token_budget``,
    ``pass_latency_ms`` and ``max_batched_tokens``."""

    name = "builtin"

    def __init__(self, backend: Backend, metrics: Metrics,
                 config: RunnerConfig | None = None) -> None:
        config = config or RunnerConfig()
        self.backend = self.target = backend
        self.metrics = metrics
        self.max_kv_bytes = config.max_kv_bytes
        metrics.pass_cost_error.set_function(lambda: self.scheduler.cost.error)
        metrics.kv_pages_used.set_function(lambda: backend.kv_pages()[0])
        metrics.kv_pages_free.set_function(lambda: backend.kv_pages()[1])
        self._own_executor = backend.thread is None
        self.executor: Executor = backend.thread.executor if backend.thread is not None else \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="spececd-verify")
        self.scheduler = BatchScheduler(backend, self.executor, metrics, config.max_batch,
                                        inline=self._own_executor,
                                        token_budget=config.budget(),
                                        pass_latency_s=config.pass_latency_ms / 1e3,
                                        max_batched_tokens=config.max_batched_tokens)
        self._caches: dict[str, CachedSequence] = {}
        self._acceptance: dict[tuple[str, str], DepthAcceptance] = {}  # session, source
        self._sources: dict[str, DepthAcceptance] = {}  # by draft source, every session's
        self._matchers: dict[str, ConstraintMatcher] = {}
        self._busy: set[str] = set()  # sessions with a verification queued or running
        self._last_used: dict[str, float] = {}
        self.kv_evictions = 0

    width = 0  # any draft the limits allow, in one forward

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
            return await self.scheduler.verify(sequence, request, matcher,
                                               self._accepting(key, request))
        except BaseException:
            self._caches.pop(key, None)  # a failed pass may have left it half-updated
            self._matchers.pop(key, None)
            raise
        finally:
            self._busy.discard(key)
            self._last_used[key] = time.monotonic()

    def _accepting(self, key: str, request: VerifyRequest) -> DepthAcceptance:
        """``key``'s acceptance by depth for the draft source ``request`` shows (one per
        source: an edge may send trees and chains in turn, and each keeps its record)."""
        source = ("tree" if request.parents is not None
                  else "probs" if request.draft_probs is not None else "ids")
        acceptance = self._acceptance.get((key, source))
        if acceptance is None:
            prior = self._sources.setdefault(source, DepthAcceptance())
            acceptance = self._acceptance[key, source] = DepthAcceptance(prior)
        return acceptance

    def _matcher(self, key: str, constraint: Constraint) -> ConstraintMatcher:
        """``key``'s matcher for ``constraint`` (compiled when the hello was answered, so
        from the cache), new when the session's constraint changed."""
        matcher = self._matchers.get(key)
        if matcher is None or matcher.compiled.constraint != constraint:
            grammars = grammars_for(self.backend.tokenizer, self.backend.vocab_size)
            matcher = self._matchers[key] = grammars.compile(constraint).matcher()
        return matcher

    def generation(self, key: str, request: GenerateRequest, hint_start: int,
                   hint: tuple[int, ...]) -> Generation | None:
        return None  # stepped by the service, one verification a step

    def _cap_kv(self, key: str, tokens_needed: int) -> None:
        """Free the KV caches of the least recently used idle sessions until the total,
        with ``tokens_needed`` more for ``key``, fits ``max_kv_bytes``. An evicted session
        keeps its place: its next pass re-prefills from its context."""
        cap, per_token = self.max_kv_bytes, self.backend.kv_bytes_per_token
        if not cap or not per_token:
            return
        block = self.backend.kv_block  # a cache is held in whole blocks (a paged one's pages)

        def held(tokens: int) -> int:
            return -(-tokens // block) * block * per_token

        total = sum(held(self.kv_tokens(other)) for other in list(self._caches)
                    if other != key) + held(tokens_needed)
        idle = sorted((other for other in self._caches
                       if other != key and other not in self._busy),
                      key=lambda other: self._last_used.get(other, 0.0))
        for victim in idle:
            if total <= cap:
                break
            total -= held(self.kv_tokens(victim))
            self._caches.pop(victim).truncate(0)  # its pages back now, not at collection
            self.kv_evictions += 1
            self.metrics.kv_evictions.inc()
            log.info("evicted a KV cache", extra={"session": victim})

    def forget(self, key: str) -> None:
        self._caches.pop(key, None)
        for source in ("tree", "probs", "ids"):
            self._acceptance.pop((key, source), None)
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
        cost, budget = self.scheduler.cost, self.scheduler.budget(1)
        return {"kv_evictions": self.kv_evictions,
                # The budget's view of a pass: its fitted cost, and the budget of one row.
                "pass_cost_ms": {"base": round(cost.predict(0, 0) * 1e3, 3),
                                 "per_row": round(cost.per_row * 1e3, 3),
                                 "per_position": round(cost.per_position * 1e3, 3),
                                 "per_context_token": round(cost.per_context * 1e3, 6),
                                 "passes": cost.passes, "fit_error": round(cost.error, 3)},
                "token_budget": budget}

    def close(self) -> None:
        self._caches.clear()
        self.scheduler.close()
        if self._own_executor:  # a backend's thread is the backend's, shared
            self.executor.shutdown(wait=False, cancel_futures=True)

