"""The engine loop without sockets: frames in through a link, frames out through ``send``,
on the torch-free toy target (:mod:`tests.toy`).

Deterministic by construction: each test puts every frame into the link before the loop
reads any, so what the engine does between steps does not depend on timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from spececd.backends.base import Backend, CachedSequence, Extend
from spececd.cloud.builtin import BuiltinRunner
from spececd.cloud.metrics import Metrics
from spececd.cloud.runners import builtin_service
from spececd.cloud.service import CloudService, Ending, Send, ServicePolicy
from spececd.protocol import messages as m
from spececd.protocol.errors import EngineFailed
from tests.support.protocol import hello
from tests.toy import ToyBackend, ToyModel, greedy

PROMPT = (5, 17, 42, 99, 3)


@pytest.fixture()
def target() -> ToyBackend:
    return ToyBackend(ToyModel(seed=0))


def generated(replies: list[m.Message]) -> bool:
    return any(isinstance(r, m.Tokens) and r.done for r in replies)


def run(engine: CloudService, frames: Sequence[bytes],
        until: Callable[[list[m.Message]], bool] | None = generated
        ) -> tuple[list[m.Message], Ending]:
    """Serve one link that received ``frames``; the client leaves once the replies
    satisfy ``until`` (None: it stays). The decoded replies and how the link ended."""
    replies: list[m.Message] = []

    async def main() -> Ending:
        link = engine.open()
        for frame in frames:
            link.put(frame)

        async def send(frame: bytes) -> None:
            replies.append(m.decode(frame))
            if until is not None and until(replies):
                link.end()

        return await engine.serve(link, send)

    return replies, asyncio.run(main())


def test_a_hint_that_arrives_before_a_step_is_verified_and_used(
        target: ToyBackend) -> None:
    expected = greedy(target, PROMPT, 12)
    engine = builtin_service(target)
    # The hint holds the target's own next 6 tokens, and is there before the first step.
    replies, _ = run(engine, [hello(target), m.encode(m.Generate(1, 0, PROMPT, 12)),
                              m.encode(m.Hint(len(PROMPT), tuple(expected[:6])))])
    tokens = [r for r in replies if isinstance(r, m.Tokens)]
    assert [t for r in tokens for t in r.token_ids] == expected
    assert (tokens[0].drafted, tokens[0].accepted) == (6, 6)
    assert tokens[0].token_ids == tuple(expected[:7])  # six hinted and one of its own
    assert all(r.drafted == 0 for r in tokens[1:])  # the hint is used up
    assert sum(len(r.token_ids) for r in tokens) == 12 and tokens[-1].done


def test_a_wrong_hint_is_verified_and_costs_nothing(
        target: ToyBackend) -> None:
    expected = greedy(target, PROMPT, 8)
    wrong = tuple((t + 1) % target.vocab_size for t in expected[:4])
    replies, _ = run(builtin_service(target), [hello(target), m.encode(m.Generate(1, 0, PROMPT, 8)),
                                      m.encode(m.Hint(len(PROMPT), wrong))])
    tokens = [r for r in replies if isinstance(r, m.Tokens)]
    assert [t for r in tokens for t in r.token_ids] == expected
    assert (tokens[0].drafted, tokens[0].accepted, len(tokens[0].token_ids)) == (4, 0, 1)


def sample(engine: CloudService, name: str, labels: dict[str, str] | None = None) -> float:
    value = engine.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_every_token_sent_is_counted_once_generated_or_accepted(
        target: ToyBackend) -> None:
    expected = greedy(target, PROMPT, 10)
    engine = builtin_service(target)
    replies, _ = run(engine, [hello(target), m.encode(m.Generate(1, 0, PROMPT, 10)),
                              m.encode(m.Hint(len(PROMPT), tuple(expected[:3])))])
    sent = sum(len(r.token_ids) for r in replies if isinstance(r, m.Tokens))
    generated = sample(engine, "spececd_generated_tokens_total")
    accepted = sample(engine, "spececd_accepted_tokens_total")
    assert (sent, accepted, generated) == (10, 3, 7)
    # A round: one draft of four, the verifier's own token counted once.
    engine = builtin_service(target)
    run(engine, [hello(target), m.encode(m.Draft(1, 0, PROMPT, tuple(expected[:4])))],
        until=lambda replies: len(replies) == 2)
    assert sample(engine, "spececd_generated_tokens_total") == 1
    assert sample(engine, "spececd_accepted_tokens_total") == 4
    assert sample(engine, "spececd_drafts_total") == 1


class FailingBackend:
    """The target, except that a pass over a chosen token raises: a backend
    failure the engine must turn into a typed error for that session alone."""

    def __init__(self, backend: Backend, poison: int) -> None:
        self._backend, self.poison = backend, poison
        self.name, self.vocab_size = backend.name, backend.vocab_size
        self.max_context, self.tokenizer = backend.max_context, backend.tokenizer
        self.description, self.kv_bytes_per_token = "failing", backend.kv_bytes_per_token
        self.thread = backend.thread
        self.tree_attention = backend.tree_attention
        self.kv_block = backend.kv_block

    def new_sequence(self) -> CachedSequence:
        return self._backend.new_sequence()

    def kv_pages(self) -> tuple[int, int]:
        return self._backend.kv_pages()

    def extend_batch(self, items: Sequence[Extend]) -> list[Any]:
        if any(self.poison in item.ids for item in items):
            raise RuntimeError("device lost")
        return [item.sequence.extend(item.ids, item.keep) for item in items]


def test_a_failed_verification_is_a_typed_error_and_the_session_goes_on(
        target: ToyBackend) -> None:
    expected = greedy(target, PROMPT, 3)
    poison = next(t for t in range(target.vocab_size) if t not in (*expected, *PROMPT))
    backend = FailingBackend(target, poison)
    replies, ending = run(builtin_service(backend), [
        hello(target), m.encode(m.Draft(1, 0, PROMPT, (poison, poison))),
        m.encode(m.Draft(2, 0, PROMPT, tuple(expected[:2])))],
        until=lambda replies: len(replies) == 3)
    assert isinstance(replies[1], m.Error) and replies[1].code == "verification_failed"
    assert replies[1].seq == 1 and not replies[1].fatal
    assert replies[2] == m.Verdict(2, 2, expected[2], replies[2].verify_s)  # type: ignore[union-attr]
    assert ending is Ending.CLIENT_LEFT


def test_idle_links_end_and_a_full_server_refuses_with_a_typed_error(target: Backend) -> None:
    engine = builtin_service(target, policy=ServicePolicy(max_sessions=1, idle_timeout=0.05))
    _replies, ending = run(engine, [hello(target)], until=None)
    assert ending is Ending.IDLE and engine.evicted_idle == 1 and not engine.links

    async def full() -> tuple[list[m.Message], Ending]:
        first, second = engine.open(), engine.open()
        sent: list[m.Message] = []

        async def send(frame: bytes) -> None:
            sent.append(m.decode(frame))

        ending = await engine.serve(second, send)
        first.end()
        await engine.serve(first, send)
        return sent, ending

    sent, ending = asyncio.run(full())
    assert ending is Ending.REFUSED
    assert isinstance(sent[0], m.Error) and sent[0].code == "server_busy" and sent[0].fatal
    assert not engine.links


def test_draining_refuses_new_work_and_lets_sessions_go(target: Backend) -> None:
    """SIGTERM's drain: an idle session gets a fatal ``draining`` error at once (its edge
    reconnects elsewhere), a new one is refused the same way, and readiness goes."""
    engine = builtin_service(target)

    async def main() -> tuple[list[m.Message], Ending, list[m.Message], Ending, bool]:
        idle = engine.open()
        idle.put(hello(target))
        seen: list[m.Message] = []

        async def send(frame: bytes) -> None:
            seen.append(m.decode(frame))

        serving = asyncio.ensure_future(engine.serve(idle, send))
        while not seen:  # the welcome: the session now waits for its next frame
            await asyncio.sleep(0.01)
        await engine.drain(timeout=5.0)
        ended = await serving
        refused: list[m.Message] = []

        async def collect(frame: bytes) -> None:
            refused.append(m.decode(frame))

        late = engine.open()
        late_ending = await engine.serve(late, collect)
        return seen, ended, refused, late_ending, engine.ready()

    seen, ended, refused, late_ending, ready = asyncio.run(main())
    assert isinstance(seen[0], m.Welcome) and ended is Ending.DRAINED
    for error in (seen[-1], refused[0]):
        assert isinstance(error, m.Error) and error.code == "draining" and error.fatal
    assert late_ending is Ending.DRAINED and not ready
    assert not engine.links
    engine.close()


def test_frames_behind_one_that_ends_a_generation_are_still_handled(
        target: ToyBackend) -> None:
    # A draft ends the generation under way and a close follows it in the same read: the
    # draft gets its verdict and the close ends the session (a loop that dropped the rest
    # of what it had read would leave the session open, waiting for frames).
    frames = [hello(target), m.encode(m.Generate(1, 0, PROMPT, 50)),
              m.encode(m.Draft(2, 0, PROMPT, (1, 2), None)), m.encode(m.Close())]
    replies, ending = run(builtin_service(target, policy=ServicePolicy(idle_timeout=2.0)), frames,
                          until=None)
    assert ending is Ending.CLOSED  # not IDLE
    assert [type(r) for r in replies] == [m.Welcome, m.Verdict]
    assert replies[1].seq == 2  # type: ignore[attr-defined]


class Stalled:
    """A runner's own generation (as vLLM's) whose step never ends: a request waiting for
    a slot, or a long prefill."""

    def __init__(self) -> None:
        self.closed = False

    async def step(self) -> Any:
        await asyncio.Event().wait()

    def hinted(self, start: int, hint: tuple[int, ...]) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


class StallingRunner(BuiltinRunner):
    def generation(self, key: str, request: Any, hint_start: int,
                   hint: tuple[int, ...]) -> Stalled:
        self.stalled = Stalled()
        return self.stalled


@pytest.mark.parametrize("how", ["client_leaves", "server_drains"])
def test_a_runners_own_step_is_abandoned_when_the_client_leaves_or_the_server_drains(
        target: ToyBackend, how: str) -> None:
    # A loop that only looked at the client's leaving or the drain between steps would
    # wait for a step that never ends (and, woken by the end of the link, spin on it).
    metrics = Metrics()
    runner = StallingRunner(target, metrics)
    service = CloudService(runner, metrics=metrics)
    replies: list[m.Message] = []

    async def main() -> Ending:
        link = service.open()
        for frame in (hello(target), m.encode(m.Generate(1, 0, PROMPT, 8))):
            link.put(frame)

        async def send(frame: bytes) -> None:
            replies.append(m.decode(frame))

        serving = asyncio.ensure_future(service.serve(link, send))
        await asyncio.sleep(0.05)
        if how == "client_leaves":
            link.end()
            return await asyncio.wait_for(serving, 5)
        await service.drain(5)
        return await asyncio.wait_for(serving, 5)

    ending = asyncio.run(main())
    assert runner.stalled.closed  # the runner was told to stop generating
    if how == "client_leaves":
        assert ending is Ending.CLIENT_LEFT and [type(r) for r in replies] == [m.Welcome]
    else:
        assert ending is Ending.DRAINED or isinstance(replies[-1], m.Error)
        assert isinstance(replies[-1], m.Error) and replies[-1].code == "draining"


class StalledPassRunner(BuiltinRunner):
    """A runner whose passes wait until told (``release``): a round stays queued."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.release = asyncio.Event()
        self.cancelled = 0

    async def verify(self, key: str, request: Any) -> Any:
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().verify(key, request)


@pytest.mark.parametrize("client", ["leaves", "half_closes", "stays"])
def test_a_round_whose_client_leaves_before_its_pass_is_dropped(
        target: ToyBackend, client: str) -> None:
    """A client that vanishes while its draft waits for a pass (a long prompt's prefill
    behind others) takes the pass with it, and the frames it sent after: the others do
    not wait for work nobody reads. A client that only ends its input (a gRPC half-close)
    or stays gets its verdict."""
    metrics = Metrics()
    runner = StalledPassRunner(target, metrics)
    service = CloudService(runner, metrics=metrics)
    expected = greedy(target, PROMPT, 3)
    replies: list[m.Message] = []

    async def main() -> Ending:
        link = service.open()
        for frame in (hello(target), m.encode(m.Draft(1, 0, PROMPT, tuple(expected[:2]))),
                      m.encode(m.Draft(2, 3, PROMPT[3:], tuple(expected[:2])))):
            link.put(frame)

        async def send(frame: bytes) -> None:
            replies.append(m.decode(frame))
            if client == "stays" and isinstance(replies[-1], m.Verdict):
                link.end()

        serving = asyncio.ensure_future(service.serve(link, send))
        await asyncio.sleep(0.05)
        if client == "leaves":
            link.leave()
        else:
            if client == "half_closes":
                link.end()
            runner.release.set()
        return await asyncio.wait_for(serving, 5)

    ending = asyncio.run(main())
    assert ending is Ending.CLIENT_LEFT
    dropped = metrics.registry.get_sample_value("spececd_abandoned_passes_total")
    if client == "leaves":
        # the first draft's pass dropped, the second draft never taken
        assert runner.cancelled == 1 and dropped == 1
        assert [type(r) for r in replies] == [m.Welcome]
    else:
        assert runner.cancelled == 0 and dropped == 0
        assert replies[1] == m.Verdict(1, 2, expected[2], replies[1].verify_s)  # type: ignore[union-attr]
    assert not service.links  # released either way


class DyingRunner(BuiltinRunner):
    """The built-in runner over a :class:`FailingBackend`, gone for good once a pass failed
    (as vLLM's engine is once its worker dies): what makes the service fail."""

    def alive(self) -> bool:
        return not self.backend.failed  # type: ignore[attr-defined]


class RecordingFailingBackend(FailingBackend):
    failed = False

    def extend_batch(self, items: Sequence[Extend]) -> list[Any]:
        try:
            return super().extend_batch(items)
        except RuntimeError:
            self.failed = True
            raise


def check_prompt(backend: Backend) -> tuple[int, ...]:
    return tuple(backend.tokenizer.encode("Hello")[:4]) or (0,)


def test_the_engine_check_generates_and_names_the_cause_when_it_cannot(
        target: ToyBackend) -> None:
    asyncio.run(builtin_service(target).check())  # a healthy engine passes
    broken = builtin_service(FailingBackend(target, check_prompt(target)[0]))
    with pytest.raises(EngineFailed, match="device lost") as caught:
        asyncio.run(broken.check())
    assert "builtin engine cannot generate" in str(caught.value)
    assert not broken.links  # the check's session is released


def test_a_runner_gone_for_good_fails_every_session_with_the_cause(
        target: ToyBackend) -> None:
    """An idle session, the one whose request killed the runner, and a late one each get a
    fatal ``engine_failed`` naming the cause, and :attr:`failed` is set (the server
    drains and exits non-zero)."""
    expected = greedy(target, PROMPT, 3)
    poison = next(t for t in range(target.vocab_size) if t not in (*expected, *PROMPT))
    backend = RecordingFailingBackend(target, poison)
    metrics = Metrics()
    engine = CloudService(DyingRunner(backend, metrics), metrics=metrics)  # type: ignore[arg-type]

    async def main() -> tuple[list[m.Message], list[m.Message], list[m.Message]]:
        idle_seen: list[m.Message] = []
        killer_seen: list[m.Message] = []
        late_seen: list[m.Message] = []
        idle, killer = engine.open(), engine.open()
        idle.put(hello(target))

        def into(seen: list[m.Message]) -> Send:
            async def send(frame: bytes) -> None:
                seen.append(m.decode(frame))
            return send

        idle_task = asyncio.ensure_future(engine.serve(idle, into(idle_seen)))
        while not idle_seen:
            await asyncio.sleep(0.01)
        killer.put(hello(target))
        killer.put(m.encode(m.Draft(1, 0, PROMPT, (poison, poison))))
        ending = await asyncio.wait_for(engine.serve(killer, into(killer_seen)), 5)
        assert ending is Ending.CLOSED  # the fatal error closed it
        assert await asyncio.wait_for(idle_task, 5) is Ending.DRAINED
        await engine.serve(engine.open(), into(late_seen))
        return idle_seen, killer_seen, late_seen

    idle_seen, killer_seen, late_seen = asyncio.run(main())
    for error in (idle_seen[-1], killer_seen[-1], late_seen[0]):
        assert isinstance(error, m.Error) and error.code == "engine_failed" and error.fatal
        assert "device lost" in error.message and "builtin engine failed" in error.message
    assert killer_seen[-1].seq == 1  # type: ignore[union-attr]
    assert engine.failed.is_set() and not engine.ready() and not engine.alive()
    assert not engine.links


def test_closing_the_service_waits_for_the_grammars_warm_up(
        target: ToyBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammars' warm-up runs in xgrammar's C++ code on a thread of its own; a process
    that ends while it does aborts (a server stopped as it began serving exited -6), so
    closing the service waits for it."""
    import threading
    import time

    from spececd import grammar

    began, finished = threading.Event(), threading.Event()

    def slow_grammars(tokenizer: Any, vocab_size: int) -> Any:
        began.set()
        time.sleep(0.5)
        finished.set()
        raise grammar.InputError("no grammars here")

    monkeypatch.setattr(grammar, "grammars_for", slow_grammars)
    service = CloudService(BuiltinRunner(target, Metrics()), metrics=Metrics())
    assert began.wait(5)
    service.close()
    assert finished.is_set()
