"""Unary verification, for clients that bring their own drafter (gRPC ``VerifyDraft`` and
``BatchVerify``, HTTP ``POST .../verify``): every call carries the whole prefix and a draft,
and gets one verdict back.

Each call is turned into SpecECD's own frames on a service :class:`~spececd.cloud.service.Link`,
so limits, typed errors, batching and metrics are the service's. Calls that name the same
session key reuse one link, and with it the target's KV cache: the prefix is compared with
what that link holds and only the new part is fed, so the cost stays incremental even
though the client re-sends everything. A call without a key gets a link of its own for
that call. The auth token is part of the key, so a call never rides on a link another
token opened: each new link is greeted with the call's own token and checked by the
session state machine like any hello.

A link idle for the engine's idle timeout is closed by the engine; the next call with its
key opens a new one from the full prefix, so nothing is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from spececd.cloud.service import CloudService, Link
from spececd.core.sampling import SparseProbs
from spececd.core.tokens import common_prefix
from spececd.protocol import messages as m
from spececd.protocol.errors import UnexpectedMessage, error_for_code


@dataclass(frozen=True)
class UnaryParams:
    """A unary session's verification mode and sampling parameters (as in ``Hello``)."""

    mode: str = "match"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    threshold: float = 0.0  # threshold mode (lossy) only


@dataclass(frozen=True)
class UnaryVerdict:
    num_accepted: int  # drafted tokens kept, from the first
    next_token: int  # the target's own token after them (correction or bonus)
    total_tokens: int  # the context's length after this verdict
    verify_s: float
    lossy: bool = False  # the session's welcome said its mode is lossy


@dataclass
class _Entry:
    link: Link
    replies: asyncio.Queue[bytes | None]
    task: asyncio.Task[object] | None = None
    params: UnaryParams | None = None
    lossy: bool = False
    history: tuple[int, ...] = ()  # what the link's session holds
    seq: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class UnarySessions:
    def __init__(self, engine: CloudService) -> None:
        self.engine = engine
        self._entries: dict[tuple[str, str], _Entry] = {}

    async def verify(self, key: str, auth_token: str, params: UnaryParams,
                     prefix: Sequence[int], draft: Sequence[int],
                     draft_probs: Sequence[SparseProbs] | None = None) -> UnaryVerdict:
        """Verify ``draft`` after ``prefix`` (the whole context, every call). Raises the
        :class:`~spececd.protocol.errors.ProtocolError` the engine answered."""
        entry = self._entry((key, auth_token))
        try:
            async with entry.lock:
                if entry.params != params:
                    reply = await self._exchange(entry, m.encode(m.Hello(
                        m.PROTOCOL_VERSION, self.engine.fingerprint, params.mode,
                        params.temperature, params.top_k, params.top_p, params.seed,
                        auth_token, params.threshold)))
                    if not isinstance(reply, m.Welcome):
                        raise UnexpectedMessage(f"expected a welcome, got {reply}")
                    entry.params, entry.history, entry.lossy = params, (), reply.lossy
                # What the new prefix keeps of it (at least one of its tokens is sent).
                held = common_prefix(entry.history, prefix[:len(prefix) - 1])
                entry.seq += 1
                reply = await self._exchange(entry, m.encode(m.Draft(
                    entry.seq, held, tuple(prefix[held:]), tuple(draft),
                    tuple(draft_probs) if draft_probs is not None else None)))
                if not isinstance(reply, m.Verdict):
                    raise UnexpectedMessage(f"expected a verdict, got {reply}")
                entry.history = (*prefix, *draft[:reply.num_accepted], reply.next_token)
                return UnaryVerdict(reply.num_accepted, reply.next_token, len(entry.history),
                                    reply.verify_s, entry.lossy)
        finally:
            if not key:
                entry.link.end()

    async def close(self, key: str, auth_token: str) -> bool:
        """End a session; whether there was one."""
        return self._drop((key, auth_token))

    def _entry(self, key: tuple[str, str]) -> _Entry:
        entry = self._entries.get(key) if key[0] else None
        if entry is not None and entry.task is not None and not entry.task.done():
            return entry
        link = self.engine.open()
        replies: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def send(frame: bytes) -> None:
            replies.put_nowait(frame)

        async def serve() -> object:
            try:
                return await self.engine.serve(link, send)
            finally:
                replies.put_nowait(None)
                if self._entries.get(key) is entry:
                    del self._entries[key]

        entry = _Entry(link, replies)
        entry.task = asyncio.get_running_loop().create_task(serve())
        if key[0]:
            self._entries[key] = entry
        return entry

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        entry.link.end()
        return True

    async def _exchange(self, entry: _Entry, frame: bytes) -> m.Message:
        entry.link.put(frame)
        reply = await entry.replies.get()
        if reply is None:
            raise UnexpectedMessage("the session ended; start a new one")
        message = m.decode(reply)
        if isinstance(message, m.Error):
            raise error_for_code(message.code, message.message)
        return message

    def close_all(self) -> None:
        for key in list(self._entries):
            self._drop(key)


