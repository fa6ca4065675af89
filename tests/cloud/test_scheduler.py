"""The batch scheduler (:class:`~spececd.cloud.scheduler.BatchScheduler`) on the toy
target, without an engine: jobs queued together run as one batched pass, a failing pass
fails only the job that broke it, and a cancelled job is skipped.

Deterministic by construction: every job is queued before the scheduler's worker first
runs (asyncio runs ready tasks in the order they became ready)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from spececd.backends.base import CachedSequence, Extend
from spececd.cloud.metrics import Metrics
from spececd.cloud.scheduler import (
    BatchScheduler,
    Pass,
    VerificationError,
    _Job,
    run_verifications,
)
from spececd.core.budget import DepthAcceptance
from spececd.core.params import Mode, SamplingParams
from spececd.core.sampling import SparseProbs
from spececd.protocol.cloud_session import VerifyRequest
from tests.toy import ToyBackend, ToyModel, greedy

POISON = 255  # a drafted token the failing backend refuses


class Recording(ToyBackend):
    """The toy target, recording the sequences of each batched pass; a pass that holds
    :data:`POISON` among its new tokens raises, as a backend that failed would."""

    def __init__(self) -> None:
        super().__init__(ToyModel(seed=0))
        self.batches: list[list[CachedSequence]] = []
        self.extended: list[int] = []  # new positions of each batched forward

    def extend_batch(self, items: Sequence[Extend]) -> list[np.ndarray]:
        assert items, "a pass of nothing (transformers' extend_batch refuses one)"
        self.batches.append([item.sequence for item in items])
        self.extended.append(sum(len(item.ids) for item in items))
        if any(POISON in item.ids for item in items):
            raise RuntimeError("scripted: the pass failed")
        return super().extend_batch(items)


@pytest.fixture()
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


def request(prompt: list[int], tokens: list[int]) -> VerifyRequest:
    return VerifyRequest(seq=1, context=tuple(prompt), tokens=tuple(tokens), draft_probs=None,
                         mode=Mode.GREEDY, params=SamplingParams(temperature=0.0, seed=0))


PROMPTS = [list(b"alpha"), list(b"beta gamma"), list(b"delta"), list(b"x"), list(b"yz")]


def jobs(backend: ToyBackend) -> list[tuple[CachedSequence, VerifyRequest, list[int]]]:
    """One job per prompt: the target's own next 3 tokens as the draft (all accepted),
    and what a lone verification gives: those 3 and the bonus."""
    out = []
    for prompt in PROMPTS:
        expected = greedy(backend, prompt, 4)
        out.append((backend.new_sequence(), request(prompt, expected[:3]), expected))
    return out


def run(scheduler: BatchScheduler, work: Sequence[tuple[CachedSequence, VerifyRequest]]
        ) -> list[Pass | BaseException]:
    async def main() -> list[Pass | BaseException]:
        try:
            return await asyncio.gather(*(scheduler.verify(sequence, req)
                                          for sequence, req in work), return_exceptions=True)
        finally:
            scheduler.close()

    return asyncio.run(main())


def batch_sizes(metrics: Metrics) -> tuple[float | None, float | None]:
    """How many passes the batch-size histogram saw, and the sessions they held."""
    registry = metrics.registry
    return (registry.get_sample_value("spececd_batch_size_count"),
            registry.get_sample_value("spececd_batch_size_sum"))


def test_sessions_queued_together_share_one_pass(executor: ThreadPoolExecutor) -> None:
    backend, metrics = Recording(), Metrics()
    work = jobs(backend)
    results = run(BatchScheduler(backend, executor, metrics, max_batch=32),
                  [(sequence, req) for sequence, req, _ in work])
    assert len(backend.batches) == 1 and len(backend.batches[0]) == len(PROMPTS)
    assert batch_sizes(metrics) == (1.0, float(len(PROMPTS)))
    for (sequence, req, expected), result in zip(work, results, strict=True):
        assert isinstance(result, Pass) and result.batch == len(PROMPTS)
        # Each session's verdict is its own, as if verified alone (a batch that mixed up
        # rows or caches would give another session's tokens).
        assert result.result.num_accepted == 3 and result.result.next_token == expected[3]
        assert sequence.tokens[:len(req.context) + 3] == [*req.context, *expected[:3]]


def test_max_batch_splits_the_queue(executor: ThreadPoolExecutor) -> None:
    backend, metrics = Recording(), Metrics()
    results = run(BatchScheduler(backend, executor, metrics, max_batch=2),
                  [(sequence, req) for sequence, req, _ in jobs(backend)])
    assert [len(batch) for batch in backend.batches] == [2, 2, 1]
    assert [r.batch for r in results if isinstance(r, Pass)] == [2, 2, 2, 2, 1]
    assert batch_sizes(metrics) == (3.0, 5.0)


def test_a_failing_pass_fails_only_the_job_that_broke_it(
        executor: ThreadPoolExecutor) -> None:
    backend, metrics = Recording(), Metrics()
    work = jobs(backend)
    sequence, req, _ = work[2]
    work[2] = (sequence, request(list(req.context), [POISON]), [])
    results = run(BatchScheduler(backend, executor, metrics),
                  [(sequence, req) for sequence, req, _ in work])
    assert isinstance(results[2], VerificationError)
    assert "scripted: the pass failed" in str(results[2])
    for i, ((_, _, expected), result) in enumerate(zip(work, results, strict=True)):
        if i != 2:
            assert isinstance(result, Pass), result
            assert (result.result.num_accepted, result.result.next_token) == (3, expected[3])
    # The batch failed, then each job ran alone; only the good ones count as passes.
    assert [len(batch) for batch in backend.batches] == [5, 1, 1, 1, 1, 1]
    assert batch_sizes(metrics) == (4.0, 4.0)


def test_a_cancelled_job_is_skipped(executor: ThreadPoolExecutor) -> None:
    backend = Recording()
    work = jobs(backend)[:3]
    scheduler = BatchScheduler(backend, executor, Metrics())

    async def main() -> list[Pass | BaseException]:
        tasks = [asyncio.ensure_future(scheduler.verify(sequence, req))
                 for sequence, req, _ in work]
        await asyncio.sleep(0)  # each task queues its job; the worker has not run yet
        tasks[1].cancel()
        try:
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            scheduler.close()

    results = asyncio.run(main())
    assert isinstance(results[1], asyncio.CancelledError)
    assert isinstance(results[0], Pass) and isinstance(results[2], Pass)
    # The pass held the other two only: the cancelled session's cache was never touched.
    assert backend.batches == [[work[0][0], work[2][0]]]
    assert work[1][0].tokens == []


def test_where_a_pass_went_adds_up_for_chains_and_trees(executor: ThreadPoolExecutor) -> None:
    """The pass metrics: each pass's forward within its work on the model's thread, the
    work within the whole pass, one queue wait per job; a tree with a new context (whose
    prefill is a forward too) included."""
    backend, metrics = Recording(), Metrics()
    scheduler = BatchScheduler(backend, executor, metrics)
    tree = VerifyRequest(seq=1, context=tuple(PROMPTS[1]), tokens=(1, 2, 3), draft_probs=None,
                         mode=Mode.GREEDY, params=SamplingParams(temperature=0.0, seed=0),
                         parents=(-1, -1, 0))
    work = [(sequence, req) for sequence, req, _ in jobs(backend)]
    results = run(scheduler, [*work, (backend.new_sequence(), tree)])
    assert all(isinstance(result, Pass) for result in results)

    def total(name: str) -> float:
        value = metrics.registry.get_sample_value(name)
        assert value is not None, name
        return value

    passes = total("spececd_pass_seconds_count")
    assert passes == total("spececd_pass_work_seconds_count") == \
        total("spececd_pass_forward_seconds_count") >= 1
    assert total("spececd_pass_queue_seconds_count") == len(work) + 1
    forward, work_s = (total("spececd_pass_forward_seconds_sum"),
                       total("spececd_pass_work_seconds_sum"))
    assert 0 < forward <= work_s <= total("spececd_pass_seconds_sum")


def test_a_long_prompts_logprobs_come_whole_from_a_cached_sequence() -> None:
    """The prompt's log-probabilities (echo) span every context token after the first,
    across the blocks they are computed in, even where the session's cache already held
    part of the context; the verification beside them is unchanged."""
    from spececd.cloud.scheduler import PROMPT_BLOCK, run_verifications
    from spececd.core.logprobs import log_softmax

    backend = ToyBackend(ToyModel(seed=0))
    context = [(7 * i) % 200 + 1 for i in range(PROMPT_BLOCK + 40)]
    params = SamplingParams(temperature=0.0, seed=0, logprobs=2, prompt_logprobs=3)
    sequence = backend.new_sequence()
    sequence.extend(context[:100], keep=0)  # a cache from an earlier generation
    draft = greedy(backend, context, 2)
    asked = VerifyRequest(1, tuple(context), tuple(draft), None, Mode.GREEDY, params,
                          prompt_logprobs=True)
    verified = run_verifications(backend, [(sequence, asked)])
    assert verified.results[0].num_accepted == 2
    emitted, prompt = verified.logprobs[0]
    reference = log_softmax(backend.model.forward([*context, *draft]))
    assert prompt is not None and len(prompt) == len(context) - 1 and prompt.top == 3
    np.testing.assert_allclose(prompt.chosen, reference[np.arange(len(context) - 1),
                                                        context[1:]], atol=1e-5)
    np.testing.assert_array_equal(prompt.top_ids[:, 0], reference[:len(context) - 1].argmax(-1))
    assert emitted is not None and len(emitted) == 3 and emitted.top == 2
    np.testing.assert_allclose(emitted.chosen[:2], reference[len(context) - 1 + np.arange(2),
                                                             draft], atol=1e-5)
    again = dataclasses.replace(asked, seq=2, prompt_logprobs=False)
    assert run_verifications(backend, [(sequence, again)]).logprobs[0][1] is None


class Threads(Recording):
    """The toy target, recording the thread each pass ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def extend_batch(self, items: Sequence[Extend]) -> list[np.ndarray]:
        self.threads.append(threading.current_thread().name)
        return super().extend_batch(items)


def test_a_lone_short_pass_runs_on_the_loops_thread_and_a_batch_on_the_executor() -> None:
    # inline: a backend with no thread of its own. A lone session's passes after a short
    # one run on the loop's thread (no hand-off); the first, and a batch of several, run
    # on the executor, so that the loop reads what arrives meanwhile. The results are the
    # same either way.
    backend, pool = Threads(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    scheduler = BatchScheduler(backend, pool, Metrics(), inline=True)
    work = jobs(backend)

    async def main() -> list[Pass]:
        try:
            lone = [await scheduler.verify(sequence, req) for sequence, req, _ in work[:3]]
            together = await asyncio.gather(*(scheduler.verify(sequence, req)
                                              for sequence, req, _ in work[3:]))
            return [*lone, *together]
        finally:
            scheduler.close()

    loop_thread = threading.current_thread().name  # asyncio.run's loop runs on this thread
    results = asyncio.run(main())
    pool.shutdown()
    assert [name == loop_thread for name in backend.threads] == [False, True, True, False]
    assert [len(batch) for batch in backend.batches] == [1, 1, 1, 2]
    for (_, _, expected), result in zip(work, results, strict=True):
        assert result.result.num_accepted == 3 and result.result.next_token == expected[3]


def assert_greedy(backend: ToyBackend, scheduler: BatchScheduler,
                  session: Callable[[list[int]], Awaitable[list[int]]]) -> None:
    """Run ``session`` for six prompts at once on ``scheduler``; each output must be the
    target's own greedy output."""
    prompts = [*PROMPTS, list(b"q")]

    async def main() -> list[list[int]]:
        try:
            return await asyncio.gather(*(session(p) for p in prompts))
        finally:
            scheduler.close()

    for prompt, out in zip(prompts, asyncio.run(main()), strict=True):
        assert out == greedy(backend, prompt, len(out))


# -- the token budget -------------------------------------------------------------------

def test_a_budget_prefills_a_joining_prompt_in_chunks_beside_decoding_sessions(
        executor: ThreadPoolExecutor) -> None:
    """Sessions decoding get their verification in the first pass; a long prompt queued
    with them is prefilled in chunks (``keep=0`` extends in a forward of their own) and
    answered once it is all in, with the result a whole prefill gives."""
    backend = Recording()
    decoding = []
    for prompt in PROMPTS[:3]:
        expected = greedy(backend, prompt, 4)
        sequence = backend.new_sequence()
        sequence.extend(prompt[:-1], keep=0)  # its cache holds what it has seen
        decoding.append((sequence, request(prompt, expected[:3]), expected))
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, POISON, 200)]
    joining = greedy(backend, prompt, 4)
    work = [*decoding, (backend.new_sequence(), request(prompt, joining[:3]), joining)]
    scheduler = BatchScheduler(backend, executor, Metrics(), token_budget=48)
    results = run(scheduler, [(sequence, req) for sequence, req, _ in work])
    for (_, _, expected), result in zip(work, results, strict=True):
        assert isinstance(result, Pass)
        assert (result.result.num_accepted, result.result.next_token) == (3, expected[3])
    first = backend.batches[:2]  # the first pass: the joiner's chunk, then the verifications
    assert first[0] == [work[3][0]] and first[1] == [sequence for sequence, _, _ in decoding]
    assert all(isinstance(r, Pass) and r.batch == 3 for r in results[:3])
    passes = [batch for batch in backend.batches if work[3][0] in batch]
    # A chunk beside the others; then, alone in the queue, the rest whole (a lone session's
    # pass is never held to a budget).
    assert len(passes) == 2
    assert isinstance(results[3], Pass) and results[3].batch == 1


def test_prompts_past_the_cap_go_in_chunks_with_no_budget(
        executor: ThreadPoolExecutor) -> None:
    """No budget (``off``), and a cap of 64 positions a pass (``max_batched_tokens``): a
    lone 200-token prompt, and three joining at once, are prefilled in chunks of at most 64
    in forwards of their own, and answered once all in with what a whole prefill gives."""
    backend = Recording()
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, POISON, n)] for n in (200, 150, 90)]
    for group in (prompts[:1], prompts):
        expected = [greedy(backend, prompt, 4) for prompt in group]
        backend.batches.clear()
        backend.extended.clear()
        work = [(backend.new_sequence(), request(prompt, out[:3]))
                for prompt, out in zip(group, expected, strict=True)]
        scheduler = BatchScheduler(backend, executor, Metrics(), token_budget=0,
                                   max_batched_tokens=64)
        for result, out in zip(run(scheduler, work), expected, strict=True):
            assert isinstance(result, Pass)
            assert (result.result.num_accepted, result.result.next_token) == (3, out[3])
        assert max(backend.extended) <= 64
        assert len(backend.batches) > sum(len(p) for p in group) // 64


def test_greedy_output_is_identical_with_drafts_cut_by_the_budget(
        executor: ThreadPoolExecutor) -> None:
    """Six sessions decode 40 tokens each, drafting 5 a round (a wrong token now and then),
    under a budget of 10 positions a pass: the budget cuts drafts (and tells each session
    its budget), and every session's output is the target's own greedy output."""
    backend = ToyBackend(ToyModel(seed=0))
    scheduler = BatchScheduler(backend, executor, Metrics(), token_budget=10)
    rng = np.random.default_rng(2)
    cuts, budgets = [], []

    async def session(prompt: list[int]) -> list[int]:
        sequence, acceptance = backend.new_sequence(), DepthAcceptance()
        context = list(prompt)
        while len(context) - len(prompt) < 40:
            draft = greedy(backend, context, 5)
            if rng.random() < 0.3:
                draft[int(rng.integers(0, 5))] = 0
            done = await scheduler.verify(sequence, request(context, draft),
                                          acceptance=acceptance)
            cuts.append(done.verified < len(draft))
            budgets.append(done.budget)
            context += [*draft[:done.result.num_accepted], done.result.next_token]
        return context[len(prompt):]

    assert_greedy(backend, scheduler, session)
    assert any(cuts) and not all(cuts)
    assert any(budget is not None and budget < 5 for budget in budgets)


def test_prompts_joining_together_go_in_chunks_and_are_all_answered(
        executor: ThreadPoolExecutor) -> None:
    """Three long prompts queued at once under a budget of 64, beside a session decoding:
    a chunk in its first pass, then (nobody left decoding) the rest whole; each answered as
    a whole prefill would. The same prompts with nobody decoding go in whole, in one pass
    (chunks would hold up no one's token and cost a forward's fixed cost each)."""
    for decoding in (True, False):
        backend, rng = Recording(), np.random.default_rng(9)
        work = []
        for n in (150, 90, 120):
            prompt = [int(t) for t in rng.integers(0, POISON, n)]
            expected = greedy(backend, prompt, 3)
            work.append((backend.new_sequence(), request(prompt, expected[:2]), expected))
        if decoding:
            expected = greedy(backend, PROMPTS[0], 3)
            sequence = backend.new_sequence()
            sequence.extend(PROMPTS[0][:-1], keep=0)
            work.append((sequence, request(PROMPTS[0], expected[:2]), expected))
        results = run(BatchScheduler(backend, executor, Metrics(), token_budget=64),
                      [(sequence, req) for sequence, req, _ in work])
        for (_, _, expected), result in zip(work, results, strict=True):
            assert isinstance(result, Pass)
            assert (result.result.num_accepted, result.result.next_token) == (2, expected[2])
        if decoding:  # a chunk beside its token (the budget held), then the rest whole
            assert len(backend.batches[0]) < 3 and backend.batches[1] == [work[3][0]]
        else:
            assert len(backend.batches) == 1


def test_a_tree_cut_by_the_budget_answers_in_the_whole_trees_numbering(
        executor: ThreadPoolExecutor) -> None:
    """Trees in depth-first order (a node need only follow its parent) under a binding
    budget: a cut keeps the shallow nodes and renumbers them, and the accepted path each
    session gets must name the nodes of the tree it sent. Six sessions read their tokens
    from the path as the session does (``tokens[i] for i in path``); every output is the
    target's own greedy output (a path left in the cut tree's numbering emits another
    branch's tokens)."""
    backend = ToyBackend(ToyModel(seed=0))
    scheduler = BatchScheduler(backend, executor, Metrics(), token_budget=9)
    cuts = []

    async def session(prompt: list[int]) -> list[int]:
        sequence, acceptance = backend.new_sequence(), DepthAcceptance()
        context = list(prompt)
        while len(context) - len(prompt) < 24:
            g = greedy(backend, context, 3)
            wrong = (g[0] + 1) % POISON
            # A wrong branch first (a node and its child), then the target's chain.
            tokens, parents = (wrong, g[1], g[0], g[1], g[2]), (-1, 0, -1, 2, 3)
            req = dataclasses.replace(request(context, list(tokens)), parents=parents)
            done = await scheduler.verify(sequence, req, acceptance=acceptance)
            cuts.append(done.verified < 3)
            assert done.result.path is not None
            context += [*(tokens[i] for i in done.result.path), done.result.next_token]
        return context[len(prompt):]

    assert_greedy(backend, scheduler, session)
    assert any(cuts)


def test_a_pass_that_fails_outside_the_forward_fails_its_jobs_and_the_worker_lives(
        executor: ThreadPoolExecutor) -> None:
    """An exception in the pass's bookkeeping (planted: the cost fit raises once) gives the
    batch's sessions a typed error, and the next verification still runs (a worker that
    died would leave every later job waiting forever)."""
    backend = ToyBackend(ToyModel(seed=0))
    scheduler = BatchScheduler(backend, executor, Metrics())
    planted = [True]
    update = scheduler.cost.update

    def failing(rows: int, positions: int, seconds: float, context: int = 0) -> None:
        if planted.pop() if planted else False:
            raise RuntimeError("planted")
        update(rows, positions, seconds, context)

    scheduler.cost.update = failing  # type: ignore[method-assign]
    work = jobs(backend)

    async def main() -> tuple[list[Pass | BaseException], Pass]:
        try:
            first = await asyncio.wait_for(asyncio.gather(
                *(scheduler.verify(sequence, req) for sequence, req, _ in work[:2]),
                return_exceptions=True), 10)
            sequence, req, _ = work[2]
            return first, await asyncio.wait_for(scheduler.verify(sequence, req), 10)
        finally:
            scheduler.close()

    first, later = asyncio.run(main())
    assert all(isinstance(r, VerificationError) and "planted" in str(r) for r in first)
    assert later.result.next_token == work[2][2][3]


def test_sessions_decoding_are_not_held_out_of_the_batch_by_prompts_coming_in(
        executor: ThreadPoolExecutor) -> None:
    """``max_batch`` prompts join ahead of a session that is decoding, under a binding
    budget: the decoding session is verified in the first pass (a batch taken off the
    queue in order would hold it until both prompts were in, pass after pass of chunks),
    and the prompts still come in and are answered."""
    backend, rng = Recording(), np.random.default_rng(5)
    work = []
    for n in (300, 300):
        prompt = [int(t) for t in rng.integers(0, POISON, n)]
        expected = greedy(backend, prompt, 3)
        work.append((backend.new_sequence(), request(prompt, expected[:2]), expected))
    prompt = PROMPTS[0]
    expected = greedy(backend, prompt, 3)
    decoding = backend.new_sequence()
    decoding.extend(prompt[:-1], keep=0)
    work.append((decoding, request(prompt, expected[:2]), expected))
    results = run(BatchScheduler(backend, executor, Metrics(), max_batch=2, token_budget=40),
                  [(sequence, req) for sequence, req, _ in work])
    for (_, _, want), result in zip(work, results, strict=True):
        assert isinstance(result, Pass)
        assert (result.result.num_accepted, result.result.next_token) == (2, want[2])
    assert any(decoding in batch for batch in backend.batches[:2])
    assert all(len(batch) <= 2 for batch in backend.batches)


def test_what_a_pass_computed_and_read_is_counted() -> None:
    """The cost fit is fed the positions each forward computed (every row's new tokens, a
    prompt's, a draft's, and a tree's new context, prefilled in a forward of its own, on
    top) and the cached tokens its rows read; the planner is offered each session's cached
    context."""
    backend = ToyBackend(ToyModel(seed=0))
    chain = request(PROMPTS[1], [1, 2])  # a new sequence: 10 context tokens, 2 drafted
    tree = VerifyRequest(seq=1, context=tuple(PROMPTS[0]), tokens=(1, 2, 3), draft_probs=None,
                         mode=Mode.GREEDY, params=SamplingParams(temperature=0.0, seed=0),
                         parents=(-1, -1, 0))  # 5 context tokens: 4 first, then 1 + 3
    sequences = [backend.new_sequence(), backend.new_sequence()]
    done = run_verifications(backend, [(sequences[0], chain), (sequences[1], tree)])
    assert done.positions == 12 + 8
    assert done.verify_positions == 12 + 4 + 4
    assert done.verify_context == 0  # both sequences were new (the tree's 4: positions)
    accepted = done.results[0].num_accepted
    context = (*PROMPTS[1], *chain.tokens[:accepted], done.results[0].next_token)
    again = request(list(context), [3])
    loop = asyncio.new_event_loop()
    try:
        offer = _Job(sequences[0], again, loop.create_future(), 0.0).offer()
    finally:
        loop.close()
    assert (offer.context, offer.prefill) == (len(context) - 1, 0)  # after the rollback
    done = run_verifications(backend, [(sequences[0], again)])
    assert done.verify_positions == 2 and done.verify_context == len(context) - 1


def test_a_prompt_that_fits_goes_whole_into_the_verifications_forward(
        executor: ThreadPoolExecutor) -> None:
    """Beside sessions decoding, a prompt that fits the budget goes whole into the
    verifications' forward (one pass, no forward of its own), and every answer is the
    target's."""
    backend = Recording()
    decoding = []
    for prompt in PROMPTS[:3]:
        expected = greedy(backend, prompt, 2)
        sequence = backend.new_sequence()
        sequence.extend(prompt[:-1], keep=0)
        decoding.append((sequence, request(prompt, expected[:1])))
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, POISON, 40)]
    joining = (backend.new_sequence(), request(prompt, greedy(backend, prompt, 2)[:1]))
    scheduler = BatchScheduler(backend, executor, Metrics(), token_budget=60)
    results = run(scheduler, [*decoding, joining])
    assert all(isinstance(result, Pass) and result.result.num_accepted == 1
               for result in results)
    assert len(backend.batches) == 1 and len(backend.batches[0]) == 4


def test_an_exact_mode_sampled_tree_is_offered_to_the_budget_at_a_position_a_level() -> None:
    """A tree whose levels' sizes were drawn (exact mode, sampled: it carries draft
    distributions) is charged one position a level, so the budget's cut never depends on a
    draw (tests/core/test_budget.py shows the bias where it does); a tree the drafter
    shaped without drawing is charged its nodes."""
    backend = ToyBackend(ToyModel(seed=0))
    point = SparseProbs(np.array([5]), np.array([1.0], dtype=np.float32))
    shaped = dataclasses.replace(request([1, 2, 3], [5, 6, 7, 8, 9]), parents=(-1, -1, 0, 0, 2))
    drawn = dataclasses.replace(shaped, mode=Mode.EXACT, draft_probs=(point,) * 5)
    loop = asyncio.new_event_loop()
    try:
        offers = [_Job(backend.new_sequence(), req, loop.create_future(), 0.0).offer()
                  for req in (shaped, drawn)]
    finally:
        loop.close()
    assert offers[0].nodes == (2, 4, 5)
    assert offers[1].nodes == (1, 2, 3)


def test_an_idle_scheduler_holds_no_task_a_closed_loop_would_destroy(
        executor: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture) -> None:
    """A loop that ends with the scheduler idle and never closed (a server stopped without
    closing its engine, a generator left to the garbage collector) leaves no pending task
    behind: "Task was destroyed but it is pending!" was printed at exit in CI."""
    import gc

    backend = ToyBackend(ToyModel(seed=0))
    scheduler = BatchScheduler(backend, executor, Metrics())
    sequence, req, expected = jobs(backend)[0]
    loop = asyncio.new_event_loop()
    done = loop.run_until_complete(scheduler.verify(sequence, req))
    assert [*req.tokens, done.result.next_token] == expected
    loop.run_until_complete(asyncio.sleep(0))  # the worker sees the empty queue and ends
    loop.close()
    with caplog.at_level("ERROR", logger="asyncio"):
        del scheduler, loop
        gc.collect()
    assert "Task was destroyed" not in caplog.text


def test_a_scheduler_closed_before_its_worker_ran_still_verifies(
        executor: ThreadPoolExecutor) -> None:
    """close() cancels a worker that never ran (its own ``finally`` never clears it): the
    next job starts a new worker instead of waiting on the dead one."""
    backend = ToyBackend(ToyModel(seed=0))
    scheduler = BatchScheduler(backend, executor, Metrics())
    (first, req, _), (second, req2, expected2) = jobs(backend)[:2]

    async def main() -> list[int]:
        job = asyncio.ensure_future(scheduler.verify(first, req))
        await asyncio.sleep(0)  # queued, its worker created and not yet run
        scheduler.close()
        await asyncio.sleep(0)
        job.cancel()  # its session went with the close
        done = await asyncio.wait_for(scheduler.verify(second, req2), 10)
        return [*req2.tokens, done.result.next_token]

    assert asyncio.run(main()) == expected2


@pytest.mark.parametrize("stepped", [True, False])
def test_sessions_the_server_steps_rejoin_the_next_pass_whole(
        executor: ThreadPoolExecutor, stepped: bool) -> None:
    """Sessions whose generation the server runs queue their next step a few turns of the
    loop after their verdict. Two of four queue first and the other two during their pass:
    the passes after it hold all four (a scheduler that took the queue at once alternated
    halves: 16 cloud-only clients ran at a mean batch of 8). An edge's round is not waited
    for: its next draft crosses the network."""
    backend = Recording()
    scheduler = BatchScheduler(backend, executor, Metrics(), max_batch=32)

    async def session(prompt: list[int], delay: int) -> None:
        sequence = backend.new_sequence()
        for _ in range(delay):
            await asyncio.sleep(0)
        for _ in range(6):
            step = dataclasses.replace(request(prompt, greedy(backend, prompt, 1)),
                                       stepped=stepped)
            await scheduler.verify(sequence, step)
            for _ in range(3):  # the verdict's frame sent, the next step asked for
                await asyncio.sleep(0)

    async def main() -> None:
        try:
            await asyncio.gather(*(session(prompt, 0 if i < 2 else 1)
                                   for i, prompt in enumerate(PROMPTS[:4])))
        finally:
            scheduler.close()

    asyncio.run(main())
    sizes = [len(batch) for batch in backend.batches]
    assert sizes[0] == 2 and sum(sizes) == 24
    if stepped:
        assert sizes[1:] == [4] * 5 + [2], sizes  # the last two sessions' sixth steps
    else:
        assert 4 not in sizes[1:], sizes  # halves, as before
