"""Batched verification across sessions: continuous batching with no timer.

Sessions submit verification work (a draft to verify, or one step of a cloud-only
generation, which is a verification of an empty draft). One worker takes *everything*
queued, up to ``max_batch``, and runs it as one batched target forward pass on the model
thread (a lone session's short pass, on a backend without a thread of its own, on the
loop's: :class:`BatchScheduler`); whatever arrives meanwhile forms the next batch, with
the sessions the server steps itself that the pass answered, which queue their next step
a few turns of the loop later (``_rejoin``). So the batching window is the duration of the
pass before it: a lone client never waits for a timer, and under load the batch grows by
itself. Each session keeps its own KV cache, in pages of one pool that the pass reads
(``Backend.extend_batch``).

A job with a constraint carries its session's
:class:`~spececd.grammar.ConstraintMatcher`: before verification the target's logits at
every row (drafted positions, the bonus, a tree's siblings) are masked to what the
constraint allows there, so a drafted token it refuses has probability zero and is
rejected, and the token the verifier adds is always allowed.

When the session asked for log-probabilities (:mod:`spececd.core.logprobs`), the same pass
gives them: of each token the verification emits, from the row that decided it, and on
the first request after a hello that asked for the prompt's, of every context token after
the first (the context is then fed whole, its cached part too, keeping every row). Under a
constraint they are the masked distribution's, as vLLM reports them.

Under load each pass is held to a **token budget** (:mod:`spececd.core.budget`):
``token_budget`` positions per pass, or (``auto``) the most a pass of the rows queued
computes within ``pass_latency_s``, from what passes have cost on this runner (fitted as
it runs). Sessions decoding go first, each with its token; drafts' positions follow in
order of their worth (each session's acceptance by depth, :class:`DepthAcceptance`) while
they pay; prompts fill the rest in chunks (a session whose prompt is not all in gets no
result until it is: its chunks extend its cache, pass after pass, at the head of the
queue). A draft cut to a leading prefix before the pass is a shorter draft: lossless; a
chain keeps its first token past the cut, decided at the last row as the whole chain's
verification decides it (:func:`~spececd.core.budget.cut_draft`), so that its block ends
where the edge put it and a seeded exact-mode sample is the same whatever the cut. A pass
whose work fits the budget, or that holds one session, runs whole. Each result carries the
session's budget for its next request (:attr:`Pass.budget`): the leading positions of its
own worth the level the last passes verified (None while the budget does not bind).

Batching and budgets change nothing but floating-point rounding: every session's tokens, RNG
stream and acceptance decisions are its own (the randomness is per position), except in
exact mode where the edge does not send the rest of a cut block (``k`` auto, ``--proactive
auto``, an edge older than this rule) and for a cut tree, verified as a smaller tree: a cut
moves an exact-mode block's end there, and the tokens for a seed with it.
The scheduler knows nothing of sessions beyond the cache and the acceptance each job comes
with.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from spececd.backends.base import Backend, CachedSequence, Extend, sync
from spececd.cloud.metrics import Metrics
from spececd.cloud.runner import Pass, RunnerError
from spececd.core.budget import (
    DepthAcceptance,
    Offer,
    PassCost,
    cut_draft,
    pass_budget,
    plan,
    tree_nodes,
)
from spececd.core.logprobs import Logprobs, distribution_logprobs, log_softmax, token_logprobs
from spececd.core.sampling import VERIFIER_STREAM, greedy_tokens, process_logits, round_rng
from spececd.core.tokens import common_prefix
from spececd.core.verify import VerifyResult, tree_paths, verify
from spececd.grammar import ConstraintMatcher, mask_logits
from spececd.protocol.cloud_session import VerifyRequest

log = logging.getLogger(__name__)

PROMPT_BLOCK = 256  # rows of a prompt's logits turned into log-probabilities at a time
INLINE_BELOW_S = 0.025  # a lone session's pass this short runs on the loop's thread
LEVEL_WEIGHT = 0.3  # of the newest pass, in the level the sessions' budgets follow
MOST_BUDGET = 64  # positions a session's budget names at most (its limit cuts it further)
REJOIN_TURNS = 8  # turns of the loop a pass waits for the steps its server-run sessions queue


class VerificationError(RunnerError):
    """A verification pass failed (the backend raised); the job's cache is unusable."""


@dataclass(frozen=True)
class Verified:
    """One batch's results, in order, and where its time went: ``work_s`` the whole batch,
    of which ``forward_s`` the target's forward passes (a tree's new context included);
    the rest is syncing the caches, logits processing, verification, sampling and the
    caches' rollback."""

    results: list[VerifyResult]
    forward_s: float
    work_s: float
    # Per job, when asked: the emitted tokens' log-probabilities and the prompt's.
    logprobs: list[tuple[Logprobs | None, Logprobs | None]] = field(default_factory=list)
    positions: int = 0  # positions the pass computed (new context and drafts, chunks too)
    prompt: int = 0  # of them, context tokens before each job's last (prompts, chunks)
    chunk_s: float = 0.0  # that forward's seconds (within forward_s and work_s)
    chunk_positions: int = 0  # of them, the chunks' forward's
    verify_context: int = 0  # cached tokens the verifications' rows read (their contexts)
    chunk_context: int = 0  # and the chunks' rows

    @property
    def verify_positions(self) -> int:
        """Positions the verifications' forwards computed (a tree's new context, in a
        forward of its own, too)."""
        return self.positions - self.chunk_positions


def run_verifications(backend: Backend, work: Sequence[tuple[CachedSequence, VerifyRequest]],
                      matchers: Sequence[ConstraintMatcher | None] = (),
                      chunks: Sequence[tuple[CachedSequence, tuple[int, ...], int]] = ()
                      ) -> Verified:
    """Verify each request's tokens (a chain or a tree) after its context on its own cached
    sequence, all in one target forward pass (``Backend.extend_batch``). A tree's cache
    then keeps the accepted path only (``CachedSequence.select``). ``matchers``: each
    job's constraint matcher (None, or none given: unconstrained), moved to its context.
    ``chunks``: ``(sequence, context, n)``, prefill the next ``n`` tokens of ``context``
    that ``sequence`` lacks, in a forward pass of their own (so that no row of the
    verifications' attention is padded to a chunk's width); nothing is returned for them."""
    began = time.perf_counter()
    forward, positions, prompt_tokens, chunk_s, chunk_context = 0.0, 0, 0, 0.0, 0
    chunked = 0  # of the positions, the chunks'
    if chunks:
        prefills = []
        for sequence, context, n in chunks:
            prefills.append(Extend(sequence, sync(sequence, context)[:n], 0))
            chunk_context += len(sequence.tokens)
        t = time.perf_counter()
        backend.extend_batch(prefills)
        forward = chunk_s = time.perf_counter() - t
        positions = prompt_tokens = chunked = sum(len(item.ids) for item in prefills)
    read = 0  # cached tokens the verifications' rows read
    items = []
    prompt_rows: list[np.ndarray | None] = []  # [len(context) - 1, vocab] where asked
    for sequence, request in work:
        if request.prompt_logprobs:
            sequence.truncate(0)  # every context position's logits, the cached ones too
        feed = sync(sequence, request.context)
        # Read as the planner's offer counts it (a tree's new context, prefilled first in a
        # forward of its own, counts as positions).
        read += len(sequence.tokens)
        scored = request.scored
        positions += len(feed) + len(scored)
        prompt_tokens += len(feed) - 1
        parents, prompt, keep = None, None, len(scored) + 1
        if request.parents is not None:
            if len(feed) > 1:  # a new context (a prompt, a resume): in first, as a chain, so
                t = time.perf_counter()  # the tree's mask spans its nodes only
                prompt = sequence.extend(feed[:-1], keep=None if request.prompt_logprobs else 0)
                forward += time.perf_counter() - t
                feed = feed[-1:]
            parents = [-1, *(p + 1 for p in request.parents)]  # under the context's last token
        elif request.prompt_logprobs:
            keep += len(feed) - 1
        items.append(Extend(sequence, [*feed, *scored], keep, parents))
        prompt_rows.append(prompt)
    t = time.perf_counter()
    all_logits = backend.extend_batch(items) if items else []  # a pass of chunks alone
    forward += time.perf_counter() - t
    results, logprobs = [], []
    for i, ((sequence, request), logits, prompt) in enumerate(
            zip(work, all_logits, prompt_rows, strict=True)):
        if request.prompt_logprobs and prompt is None:  # a chain's: the rows before the block's
            prompt, logits = logits[:len(request.context) - 1], logits[len(request.context) - 1:]
        # logits: [n + 1, vocab] ([n, vocab] for a chain cut after n - 1: request.scored)
        assert request.params.seed is not None
        matcher = matchers[i] if i < len(matchers) else None
        if matcher is not None:  # masked before anything reads them, log-probabilities too
            matcher.sync(request.context[request.params.prompt_len:])
            logits = mask_logits(logits, matcher.allowed(request.scored, request.parents))
        rngs = functools.partial(_position_rng, request.params.seed, len(request.context))
        result = verify(request.tokens, _target(logits, request), rngs, request.mode,
                        request.draft_probs, request.threshold, request.parents, request.cut)
        if result.path is not None:
            start = len(request.context)
            sequence.select(start, [start + node for node in result.path])
        results.append(result)
        logprobs.append(_logprobs(logits, request, result, prompt))
    return Verified(results, forward, time.perf_counter() - began, logprobs, positions,
                    prompt_tokens, chunk_s, chunked, read, chunk_context)


def _logprobs(logits: np.ndarray, request: VerifyRequest, result: VerifyResult,
              prompt: np.ndarray | None) -> tuple[Logprobs | None, Logprobs | None]:
    """The log-probabilities the session asked for: of the tokens ``result`` emits, each
    from the row of ``logits`` ``[len(request.scored) + 1, vocab]`` that decided it (a
    tree's rows follow its accepted path), and of the context after its first token from
    ``prompt`` ``[len(context) - 1, vocab]`` (raw, see :mod:`spececd.core.logprobs`)."""
    params = request.params
    emitted_lp = prompt_lp = None
    if params.logprobs is not None:
        n = result.num_accepted
        if result.path is None:
            rows, accepted = list(range(n + 1)), list(request.tokens[:n])
        else:
            rows = [0, *(node + 1 for node in result.path)]
            accepted = [request.tokens[node] for node in result.path]
        emitted = [*accepted, result.next_token]
        history = (*request.context, *accepted)
        values = distribution_logprobs(logits[rows], params.logprobs_mode, params, history,
                                       len(request.context))
        emitted_lp = token_logprobs(values, emitted, params.logprobs)
    if prompt is not None and params.prompt_logprobs is not None:
        top, tokens = params.prompt_logprobs, request.context[1:]
        # By blocks of rows: a long prompt's float64 copy of its whole logits is gigabytes.
        prompt_lp = Logprobs.concat([Logprobs.empty(top), *(
            token_logprobs(log_softmax(prompt[i:i + PROMPT_BLOCK]),
                           tokens[i:i + PROMPT_BLOCK], top)
            for i in range(0, len(tokens), PROMPT_BLOCK))])
    return emitted_lp, prompt_lp


def _target(logits: np.ndarray, request: VerifyRequest) -> np.ndarray:
    """The target's distributions at the root and after each scored token
    (``[len(request.scored) + 1, vocab]``), or at temperature 0 its tokens (point masses:
    no distribution is built, no draw made). Penalties depend on the tokens before a row: a
    chain's rows follow one another, a tree's row follows its node's path."""
    context, params = request.context, request.params
    process = greedy_tokens if params.greedy else process_logits
    if request.parents is None or not params.penalized:
        return process(logits, params, (*context, *request.tokens), len(context))
    histories = [context, *((*context, *(request.tokens[i] for i in path))
                            for path in tree_paths(request.parents))]
    return np.concatenate([process(logits[row:row + 1], params, history, len(history))
                           for row, history in enumerate(histories)])


def _position_rng(seed: int, start: int, offset: int) -> np.random.Generator:
    return round_rng(seed, VERIFIER_STREAM, start + offset)


@dataclass
class _Job:
    sequence: CachedSequence
    request: VerifyRequest
    future: asyncio.Future[Pass]
    queued: float  # perf_counter when submitted
    matcher: ConstraintMatcher | None = None
    acceptance: DepthAcceptance | None = None  # the session's, by depth (its budget's worth)

    def prefilling(self) -> bool:
        """Whether the job's prompt is still coming in, in chunks: it gets no result from a
        pass until its context is all in the server's cache."""
        offer = self.offer()
        return offer.prefill > 0 and offer.chunkable

    def offer(self) -> Offer:
        """The job as the budget's planner sees it (before the pass, from the request and
        the cache only)."""
        request, cached = self.request, self.sequence.tokens
        context = request.context
        held = len(cached)
        if not (held < len(context) and cached[-1:] == list(context[held - 1:held])):
            held = common_prefix(cached, context[:-1])  # behind or diverged: cut to this
        if request.prompt_logprobs:
            held = 0
        nodes = tree_nodes(request.parents, len(request.tokens),
                           drawn=request.draft_probs is not None)
        acceptance = self.acceptance or DepthAcceptance()
        return Offer(len(context) - 1 - held, tuple(acceptance.worth(len(nodes))), nodes,
                     chunkable=not request.prompt_logprobs, context=held)


class BatchScheduler:
    """``inline``: the backend may run on the loop's thread (it has no thread of its own),
    and a pass of one job after a pass shorter than ``INLINE_BELOW_S`` runs there, without
    the hand-off to the executor and back (for the default target in f16 on llama.cpp,
    232 µs of a 4.2 ms step; cloud-only generation 1.048 times as fast, side by side).
    Blocking the loop for a pass costs a lone session nothing; a batch of several, or a
    long pass, still goes to the executor, so the loop reads what arrives meanwhile for
    the next batch.

    ``token_budget``: positions per pass at most (0: no budget), or None (``auto``): learned,
    the most a pass computes within ``pass_latency_s`` (see the module docstring and
    :meth:`~spececd.core.budget.PassCost.budget`). ``max_batched_tokens``: the positions
    any pass computes at most, whatever the budget (0: no cap; ``plan``'s ``cap``)."""

    def __init__(self, backend: Backend, executor: Executor, metrics: Metrics,
                 max_batch: int = 32, inline: bool = False, token_budget: int | None = 0,
                 pass_latency_s: float = 0.1, max_batched_tokens: int = 0) -> None:
        self.backend = backend
        self.executor = executor
        self.metrics = metrics
        self.max_batch = max_batch
        self.inline = inline
        self.token_budget = token_budget
        self.pass_latency_s = pass_latency_s
        self.cap = max_batched_tokens or None
        self.cost = PassCost()  # what a pass costs here, by rows, positions and context
        self.level = 0.0  # the least worth verified, smoothed over passes (sessions' budgets)
        self._short = False  # the last pass took under INLINE_BELOW_S
        self._queue: list[_Job] = []
        self._task: asyncio.Task[None] | None = None

    async def verify(self, sequence: CachedSequence, request: VerifyRequest,
                     matcher: ConstraintMatcher | None = None,
                     acceptance: DepthAcceptance | None = None) -> Pass:
        """Run ``request`` on ``sequence`` in the next batch (masked by ``matcher``, its
        session's constraint; its draft cut by the budget by ``acceptance``, the session's,
        which the pass's outcome updates). Raises :class:`VerificationError` when the pass
        fails for this job."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Pass] = loop.create_future()
        self._queue.append(_Job(sequence, request, future, time.perf_counter(), matcher,
                                acceptance))
        # Jobs queued in this turn of the loop join the new worker's first pass; a worker
        # cancelled before it ran (close()) never cleared itself.
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        return await future

    def budget(self, rows: int, context: int = 0) -> int | None:
        """Positions a pass of ``rows`` sessions over ``context`` cached tokens may compute
        (None: no budget)."""
        return pass_budget(self.token_budget, self.cost, rows, self.pass_latency_s, context)

    async def _run(self) -> None:
        """The worker: passes while jobs are queued, then it ends (the next job starts
        another), so that an idle scheduler holds no task that a loop closed without
        :meth:`close` would destroy pending."""
        try:
            while self._queue:
                batch = self._take()
                if not batch:
                    continue
                try:
                    waiting = await self._pass(batch)
                except Exception as exc:  # planning or bookkeeping: fail the batch, not the worker
                    log.exception("a batched pass failed outside the forward")
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(VerificationError(
                                f"{type(exc).__name__}: {exc}"))
                    waiting = []
                self._queue[:0] = waiting  # prompts not all in: first in the next pass
                await self._rejoin(batch)
        finally:
            self._task = None

    async def _rejoin(self, batch: list[_Job]) -> None:
        """Let the sessions whose generation the server runs (``stepped``) and that
        ``batch`` just answered queue their next step, a few turns of the loop away, before
        the next pass is taken, unless the queue already fills one: otherwise, at 16
        cloud-only clients, the sessions split into two halves that took turns (a mean
        batch of 8). No wait for edges' rounds, whose next draft crosses the network."""
        expected = {id(job.sequence) for job in batch if job.request.stepped
                    and job.future.done() and not job.future.cancelled()
                    and job.future.exception() is None}
        for _ in range(REJOIN_TURNS if expected else 0):
            if (len(self._queue) >= self.max_batch
                    or expected <= {id(job.sequence) for job in self._queue}):
                return
            await asyncio.sleep(0)

    def _take(self) -> list[_Job]:
        """The next batch, taken off the queue: sessions decoding or verifying first (in
        the order they came, ``max_batch`` at most, less one slot while a prompt waits so
        that joining is never starved), then prompts still coming in, into the slots left
        (a prompt the budget gives no chunk runs nothing and goes back to the queue's
        head). Cancelled jobs are dropped."""
        queue = [job for job in self._queue if not job.future.done()]
        prefilling = [job.prefilling() for job in queue]
        joining = [job for job, p in zip(queue, prefilling, strict=True) if p]
        deciding = [job for job, p in zip(queue, prefilling, strict=True) if not p]
        decide = min(len(deciding), self.max_batch - 1 if joining else self.max_batch)
        batch = deciding[:decide] + joining[:self.max_batch - decide]
        taken = {id(job) for job in batch}
        self._queue = [job for job in queue if id(job) not in taken]
        return batch

    async def _pass(self, batch: list[_Job]) -> list[_Job]:
        """One batched forward pass within the budget; the jobs it only prefilled a chunk
        of (or, prompts it had no room for, nothing), to run again. If the forward fails,
        each job alone, so that one bad request fails only itself."""
        offers = [job.offer() for job in batch]
        context = sum(offer.context for offer in offers)
        chosen = plan(offers, self.budget(len(batch), context), self.cost, self.cap)
        if not any(chosen.chunks) and all(depth is None for depth in chosen.depths):
            chosen = plan(offers, None)  # nothing would run (not expected): all of it, whole
        work, matchers, chunks, verified, waiting = [], [], [], [], []
        kept: list[tuple[int, ...] | None] = []  # a cut tree's nodes, in the whole tree
        for job, offer, depth, chunk in zip(batch, offers, chosen.depths, chosen.chunks,
                                            strict=True):
            if chunk:  # before the verifications, in a forward of their own
                chunks.append((job.sequence, job.request.context, chunk))
            if depth is None:
                waiting.append(job)
                continue
            request, index = job.request, None
            if depth < len(offer.nodes):
                tokens, probs, parents, index = cut_draft(request.tokens, request.draft_probs,
                                                          request.parents, depth)
                request = dataclasses.replace(request, tokens=tokens, draft_probs=probs,
                                              parents=parents, cut=parents is None)
            work.append((job.sequence, request))
            matchers.append(job.matcher)
            kept.append(index)
            verified.append((job, depth, len(job.request.tokens)))  # positions offered
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            if self.inline and self._short and len(batch) == 1:
                done = run_verifications(self.backend, work, matchers, chunks)
            else:
                done = await loop.run_in_executor(
                    self.executor, run_verifications, self.backend, work, matchers, chunks)
        except Exception as exc:
            if len(batch) == 1:
                log.exception("verification failed")
                if not batch[0].future.done():
                    batch[0].future.set_exception(VerificationError(
                        f"{type(exc).__name__}: {exc}"))
                return []
            log.exception("batched verification failed; retrying one by one")
            for job in batch:
                self._queue[:0] = await self._pass([job])
            return []
        seconds = time.perf_counter() - start
        self._short = done.work_s < INLINE_BELOW_S
        # Each forward on its own (the chunks' rows and positions are unlike the
        # verifications': one or two rows, many positions), so that the fit tells rows'
        # cost from positions'.
        if work:
            self.cost.update(len(work), done.verify_positions, done.work_s - done.chunk_s,
                             done.verify_context)
        if chunks:
            self.cost.update(len(chunks), done.chunk_positions, done.chunk_s, done.chunk_context)
        self.level += LEVEL_WEIGHT * (chosen.level - self.level)
        self.metrics.record_batch(len(work), done.forward_s, done.work_s, seconds,
                                  [start - job.queued for job, _, _ in verified])
        self.metrics.record_budget(
            done.prompt, sum(offered for _, _, offered in verified),
            sum(len(request.scored) for _, request in work),
            sum(result.num_accepted for result in done.results), len(done.results),
            done.work_s, self.budget(len(batch), context))
        for (job, depth, _), result, logprobs, index in zip(
                verified, done.results, done.logprobs, kept, strict=True):
            if index is not None and result.path is not None:  # the cut tree's numbering:
                result = dataclasses.replace(  # the session reads the whole tree's
                    result, path=tuple(index[node] for node in result.path))
            budget = None
            if job.acceptance is not None:
                job.acceptance.observe(depth, result.num_accepted)
                if self.level > 1e-3:
                    budget = job.acceptance.budget(self.level, MOST_BUDGET)
            if not job.future.done():
                job.future.set_result(Pass(result, seconds, len(work), *logprobs,
                                           budget=budget, verified=depth))
        return waiting

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
