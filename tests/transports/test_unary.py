"""Unary verification (:class:`~spececd.transports.unary.UnarySessions`: gRPC VerifyDraft and
BatchVerify, HTTP verify) on an engine over the toy target: a session key keeps the
target's KV cache between calls, a bad token id is the engine's typed error, and the auth
token is part of the key."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from spececd.cloud.runners import builtin_service
from spececd.cloud.service import CloudService
from spececd.protocol.errors import AuthFailed, InvalidTokens
from spececd.transports.unary import UnaryParams, UnarySessions
from tests.toy import ToyBackend, ToyModel, greedy

PROMPT = list(b"while True:")
GREEDY = UnaryParams(mode="greedy", temperature=0.0)
T = TypeVar("T")


@pytest.fixture()
def target() -> ToyBackend:
    return ToyBackend(ToyModel(seed=2))


@pytest.fixture()
def expected(target: ToyBackend) -> list[int]:
    """The target's own greedy continuation of :data:`PROMPT`."""
    return greedy(target, PROMPT, 8)


def run(engine: CloudService, calls: Callable[[UnarySessions], Awaitable[T]]) -> T:
    async def main() -> T:
        sessions = UnarySessions(engine)
        try:
            return await calls(sessions)
        finally:
            sessions.close_all()
            engine.close()

    return asyncio.run(main())


@pytest.fixture()
def engine(target: ToyBackend) -> CloudService:
    """An engine that asks for a token; :func:`run` closes it."""
    return builtin_service(target, auth_token="secret")


def test_a_session_key_keeps_the_kv_cache(target: ToyBackend, expected: list[int],
                                          engine: CloudService) -> None:
    async def calls(sessions: UnarySessions) -> None:
        first = await sessions.verify("k", "secret", GREEDY, PROMPT, expected[:3])
        assert (first.num_accepted, first.next_token) == (3, expected[3])
        assert first.total_tokens == len(PROMPT) + 4
        # The client re-sends the whole prefix; the target is fed what it lacks only.
        second = await sessions.verify("k", "secret", GREEDY, [*PROMPT, *expected[:4]],
                                       expected[4:7])
        assert (second.num_accepted, second.next_token) == (3, expected[7])

    run(engine, calls)
    # First: the prompt and the draft. Second: the verdict's own token and the new draft
    # (a link per call, or a cache rebuilt from the prefix, would feed the whole prefix).
    assert target.calls == [len(PROMPT) + 3, 1 + 3]


def test_calls_without_a_key_start_from_the_prefix_each_time(
        target: ToyBackend, expected: list[int], engine: CloudService) -> None:
    async def calls(sessions: UnarySessions) -> None:
        await sessions.verify("", "secret", GREEDY, PROMPT, expected[:3])
        second = await sessions.verify("", "secret", GREEDY, [*PROMPT, *expected[:4]],
                                       expected[4:7])
        assert (second.num_accepted, second.next_token) == (3, expected[7])

    run(engine, calls)
    assert target.calls == [len(PROMPT) + 3, len(PROMPT) + 4 + 3]


def test_a_token_out_of_the_vocabulary_is_a_typed_error_and_the_session_goes_on(
        target: ToyBackend, expected: list[int], engine: CloudService) -> None:
    async def calls(sessions: UnarySessions) -> None:
        with pytest.raises(InvalidTokens):
            await sessions.verify("k", "secret", GREEDY, PROMPT, [target.vocab_size])
        verdict = await sessions.verify("k", "secret", GREEDY, PROMPT, expected[:2])
        assert (verdict.num_accepted, verdict.next_token) == (2, expected[2])

    run(engine, calls)
    assert target.calls == [len(PROMPT) + 2]  # the bad draft never reached the target


def test_the_auth_token_is_part_of_the_key(target: ToyBackend, expected: list[int],
                                           engine: CloudService) -> None:
    """A call with a wrong token and a key another token opened gets a link of its own,
    greeted with its own token, and is refused: it never rides on the open session."""
    async def calls(sessions: UnarySessions) -> None:
        await sessions.verify("k", "secret", GREEDY, PROMPT, expected[:3])
        with pytest.raises(AuthFailed):
            await sessions.verify("k", "guess", GREEDY, [*PROMPT, *expected[:4]],
                                  expected[4:7])
        # The refusal did not end the rightful session, nor its cache.
        verdict = await sessions.verify("k", "secret", GREEDY, [*PROMPT, *expected[:4]],
                                        expected[4:7])
        assert (verdict.num_accepted, verdict.next_token) == (3, expected[7])

    run(engine, calls)
    assert target.calls == [len(PROMPT) + 3, 1 + 3]
