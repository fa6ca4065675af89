"""The cloud's one service: every transport feeds frames into it and sends what it answers.

:class:`Engine` owns the target backend, the session limits, every open :class:`Link` (a
:class:`~spececd.protocol.session.CloudSession` plus its KV cache), the batching scheduler,
stream drafting and its hint wait, idle eviction, the KV cap and the metrics. A transport
does three things and nothing else:

    link = engine.open()                 # a client connected
    link.put(frame) ... link.end()       # from its reader, as frames arrive
    ending = await engine.serve(link, send)   # awaits send(reply) for every answer

``serve`` handles the link's frames in order until the client leaves, the session closes
or it idles out, and says which (:class:`Ending`). The in-process transport drives the
same loop on a background event loop, so in-process runs batch and stream-draft like
networked ones.

Model work runs on one worker thread, so the event loop stays free to read frames (hints
for a running generation among them), answer health checks and notice closed links while
a verification runs. A verification that fails answers a typed ``verification_failed``
error; nothing here raises at a transport for anything a client sent.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import AsyncIterable, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from spececd.backends import bundle
from spececd.backends.base import Backend, CachedSequence, Tokenizer, tokenizer_fingerprint
from spececd.cloud.metrics import Metrics
from spececd.cloud.scheduler import BatchScheduler, Pass, VerificationError
from spececd.core.policy import Ema
from spececd.core.sampling import Mode, SamplingParams
from spececd.core.verify import tree_depth
from spececd.protocol import messages as m
from spececd.protocol.errors import Draining, ProtocolError, ServerBusy, VerificationFailed
from spececd.protocol.session import CloudSession, GenerateRequest, Limits, State, VerifyRequest

log = logging.getLogger(__name__)

Send = Callable[[bytes], Awaitable[None]]


class Ending(enum.Enum):
    """Why :meth:`Engine.serve` returned; transports map it to their own close codes."""

    CLIENT_LEFT = "client_left"  # the link ended (the client closed or dropped it)
    CLOSED = "closed"  # the session closed: a Close frame, or a fatal error was answered
    IDLE = "idle"  # no frame within the idle timeout
    REFUSED = "refused"  # the server was full; the error frame was sent
    DRAINED = "drained"  # the server is shutting down; the draining error was sent


class Target(Protocol):
    """What the engine's bookkeeping reads of the model it serves; a :class:`Backend` has
    all of it, and so does an engine that runs the model elsewhere (vLLM)."""

    description: str
    vocab_size: int
    max_context: int
    kv_bytes_per_token: int  # 0: the KV cache is not the engine's to count
    tokenizer: Tokenizer
    tree_attention: bool


@dataclass(frozen=True)
class EnginePolicy:
    max_sessions: int = 64
    idle_timeout: float = 300.0  # seconds without a frame before a session is evicted
    max_batch: int = 32  # sessions verified in one forward pass at most
    max_kv_bytes: int = 0  # KV cache bytes held across sessions at most (0: no cap)


_WAKE = (0.0, b"")  # put by Inbox.wake; told apart by identity


def draining_error() -> Draining:
    """What a draining server answers new sessions, new rounds and streams under way."""
    return Draining("the server is shutting down; reconnect (through a balancer: to "
                    "another replica) and re-send the history")


class Inbox:
    """Frames received on one link, in order, each with its arrival time; ``None`` marks
    the end of the link. Used on the engine's event loop only."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._arrival = asyncio.Event()
        self.ended = False

    def wake(self) -> None:
        """Wake a :meth:`get` that waits (the engine is draining); frames stay queued."""
        self._queue.put_nowait(_WAKE)
        self._arrival.set()

    def put(self, frame: bytes) -> None:
        self._queue.put_nowait((time.perf_counter(), frame))
        self._arrival.set()

    def end(self) -> None:
        self.ended = True
        self._queue.put_nowait(None)
        self._arrival.set()

    async def arrived(self) -> None:
        """Return once something is queued (a frame, the end mark or a wake), taking
        nothing: a wait that is cancelled loses no frame."""
        while self._queue.empty():
            self._arrival.clear()
            await self._arrival.wait()

    async def get(self, timeout: float) -> bytes | None:
        """The next frame (None: the link ended); raises ``TimeoutError`` after ``timeout``."""
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:  # not TimeoutError itself before Python 3.11
            raise TimeoutError from None
        return None if item is None else item[1]  # _WAKE: b"", and the engine is draining

    def poll(self) -> list[tuple[float, bytes]]:
        """The frames that have arrived, without waiting; the end mark stays for ``get``."""
        frames = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is None:
                self._queue.put_nowait(None)
                break
            if item is not _WAKE:
                frames.append(item)
        return frames

    async def wait(self, timeout: float) -> list[tuple[float, bytes]]:
        """Like :meth:`poll`, but first wait up to ``timeout`` seconds for a frame."""
        if self._queue.empty() and timeout > 0:
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:  # not TimeoutError itself before Python 3.11
                return []
            if item is None:
                self._queue.put_nowait(None)
                return []
            return [*([] if item is _WAKE else [item]), *self.poll()]
        return self.poll()


class Link:
    """One client's session on the engine: its state machine, its KV cache (allocated by
    the engine on first use, freed on eviction or close) and the frames that arrived."""

    def __init__(self, engine: Engine, refusal: bytes = b"", authorized: bool = False) -> None:
        # ``authorized``: the transport checked the token already, so the hello needs none.
        self.session = CloudSession(engine.fingerprint, engine.limits,
                                    "" if authorized else engine.auth_token,
                                    engine.backend.tree_attention, engine.unsupported)
        self.inbox = Inbox()
        self.refusal = refusal  # the error frame to send instead of serving
        self.sequence: CachedSequence | None = None
        self.busy = False  # a verification of this session is queued or running
        self.last_used = time.monotonic()
        self.drafted = 0  # drafted tokens verified for this session, and accepted
        self.accepted = 0
        self._metrics = engine.metrics
        self._reported: Counter[str] = Counter()  # errors already counted in the metrics

    def put(self, frame: bytes) -> None:
        self.inbox.put(frame)

    def end(self) -> None:
        self.inbox.end()

    @property
    def closed(self) -> bool:
        return self.session.state is State.CLOSED

    @property
    def kv_tokens(self) -> int:
        return len(self.sequence.tokens) if self.sequence is not None else 0

    def accept(self, frame: bytes) -> bytes | VerifyRequest | GenerateRequest | None:
        """Run one frame through the session (cheap: no model work) and count the errors
        it answered."""
        out = self.session.receive(frame)
        if self.session.errors == self._reported:  # the usual case: no new error
            return out
        for code, n in (self.session.errors - self._reported).items():
            self._metrics.errors.labels(code).inc(n)
            log.warning("rejected a frame: %s", code, extra={
                "session": self.session.session_id, "request": self.session.request_seq,
                "code": code})
        self._reported = Counter(self.session.errors)
        return out

    def error(self, exc: ProtocolError, seq: int) -> bytes:
        frame = self.session.error(exc, seq)
        self._metrics.errors.labels(exc.code).inc()
        self._reported[exc.code] += 1
        return frame


class Engine:
    """The built-in engine: the target's backend runs here, on one worker thread, with
    sessions batched by :class:`BatchScheduler`. An engine that runs the target elsewhere
    (:class:`spececd.cloud.vllm.VllmEngine`) keeps everything but the model work:
    :meth:`_verify` and :meth:`_generate`."""

    name = "builtin"  # as ``spececd serve --engine`` names it

    def __init__(self, backend: Backend, limits: Limits | None = None,
                 policy: EnginePolicy | None = None, auth_token: str = "") -> None:
        self._setup(backend, limits, policy, auth_token)
        self._backend = backend
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spececd-verify")
        self.scheduler = BatchScheduler(backend, self.executor, self.metrics,
                                        self.policy.max_batch)

    def _setup(self, backend: Target, limits: Limits | None, policy: EnginePolicy | None,
               auth_token: str) -> None:
        limits = limits or Limits()
        self.backend = backend
        self.limits = Limits(max_draft=limits.max_draft,
                             max_context=min(limits.max_context, backend.max_context),
                             max_message_bytes=limits.max_message_bytes)
        self.policy = policy or EnginePolicy()
        self.fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
        self._bundle: bytes | None = None
        self.draining = False  # shutting down: no new sessions or rounds (drain())
        self.auth_token = auth_token
        self.metrics = Metrics()
        self.links: set[Link] = set()
        self.started = time.time()
        self.evicted_idle = 0
        self.kv_evictions = 0
        self.errors: Counter[str] = Counter()  # by error code, of released sessions
        self.metrics.active_sessions.set_function(lambda: len(self.links))
        self.metrics.kv_bytes.set_function(lambda: self.kv_tokens() * backend.kv_bytes_per_token)

    def unsupported(self, mode: Mode, params: SamplingParams) -> str:
        """Why this engine cannot serve a session in ``mode`` with ``params`` ("" when it
        can); the hello is then answered with an ``unsupported`` error."""
        return ""

    # -- what transports call ------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Shut down gracefully: refuse new sessions and new rounds with a ``draining``
        error (the edge then reconnects at once, elsewhere), let the passes under way
        finish, and return once every session is gone or ``timeout`` seconds passed."""
        self.draining = True
        log.info("draining %d sessions", len(self.links))
        for link in list(self.links):
            link.inbox.wake()
        deadline = time.monotonic() + timeout
        while self.links and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def open(self, authorized: bool = False) -> Link:
        """A link for a new client; when the server is full, one that :meth:`serve`
        answers with a ``server_busy`` error and closes. ``authorized``: the transport
        checked the client's token itself (gRPC metadata), so its hello needs none."""
        if self.draining:
            error: ProtocolError = draining_error()
            return Link(self, m.encode(m.Error(error.code, str(error), -1, True)))
        if len(self.links) >= self.policy.max_sessions:
            error = ServerBusy(f"the server holds its maximum of {self.policy.max_sessions} "
                               f"sessions; try again later")
            self.metrics.errors.labels(error.code).inc()
            return Link(self, m.encode(m.Error(error.code, str(error), -1, True)))
        link = Link(self, authorized=authorized)
        self.links.add(link)
        log.info("session opened", extra={"session": link.session.session_id,
                                          "sessions": len(self.links)})
        return link

    async def run(self, link: Link, frames: AsyncIterable[bytes], send: Send) -> Ending:
        """:meth:`serve` ``link`` while a task puts every frame of ``frames`` (a
        transport's incoming stream, which ends when the client leaves) into it."""

        async def read() -> None:
            try:
                async for frame in frames:
                    link.put(frame)
            finally:
                link.end()

        reader = asyncio.get_running_loop().create_task(read())
        try:
            return await self.serve(link, send)
        finally:
            reader.cancel()

    async def serve(self, link: Link, send: Send) -> Ending:
        """Handle ``link``'s frames until it ends, closes or idles out; release it."""
        if link.refusal:
            await send(link.refusal)
            return Ending.DRAINED if self.draining else Ending.REFUSED
        ending = Ending.CLIENT_LEFT
        try:
            while True:
                try:
                    frame = await link.inbox.get(self.policy.idle_timeout)
                except TimeoutError:
                    ending = Ending.IDLE
                    return ending
                if frame is None:
                    return ending
                if self.draining:  # new work goes to another replica
                    await send(link.error(draining_error(), -1))
                    ending = Ending.DRAINED
                    return ending
                await self._handle(link, frame, send)
                if link.closed:
                    ending = Ending.CLOSED
                    return ending
        finally:
            self.release(link, ending)

    # -- one frame -----------------------------------------------------------------------
    async def _handle(self, link: Link, frame: bytes, send: Send) -> None:
        out = link.accept(frame)
        if isinstance(out, bytes):
            if out:
                await send(out)
        elif isinstance(out, VerifyRequest):
            done = await self._verify(link, out)
            if isinstance(done, bytes):
                await send(done)
            else:
                drafted = len(out.tokens) if out.parents is None else tree_depth(out.parents)
                self._record(link, drafted, done.result.num_accepted, 1, done.seconds,
                             is_round=True)  # a tree counts its positions
                await send(link.session.verdict(out, done.result.num_accepted,
                                                done.result.next_token, done.seconds,
                                                done.result.path))
        elif isinstance(out, GenerateRequest):
            await self._generate(link, out, send)

    async def _generate(self, link: Link, request: GenerateRequest, send: Send) -> None:
        """A cloud-only generation, one frame per step. The frames that arrive meanwhile
        are taken between steps: hints for it, or anything else, which is handled as
        usual and may end it. When the hint runs dry (the target contradicted it, or used
        it up), the next step waits for a fresh one if the edge has been answering faster
        than a step takes, and otherwise generates a token of its own without waiting.

        The edge's turnaround is measured from the step that left no hint to the arrival
        of the next hint reaching past what that step generated, whether the hint then
        agrees or not: an edge whose hints all come too late must still be measured, or
        the server would never wait for them and they would stay too late."""
        session = link.session
        turnaround, step_s = Ema(0.0, weight=0.3), Ema(0.0, weight=0.3)
        dry_since: float | None = time.perf_counter()
        dry_len = len(session.context)  # the context when the hint ran dry
        while (stream := session.stream) is not None and stream.request is request:
            if await self._halted(link, send):
                return
            later = link.inbox.poll()
            if (not later and dry_since is not None and turnaround.seen and step_s.seen
                    and turnaround.value < step_s.value):
                wait = dry_since + min(step_s.value, 1.5 * turnaround.value)
                later = await link.inbox.wait(wait - time.perf_counter())
            for arrived, data in later:
                await self._handle(link, data, send)
                if session.stream is not stream:
                    return  # closed, or replaced by a new hello, generate or draft
                if dry_since is not None and stream.reach > dry_len:
                    turnaround.update(arrived - dry_since)
                    dry_since = None
            step = session.stream_step()
            done = await self._verify(link, step)
            if isinstance(done, bytes):
                session.stream = None
                await send(done)
                return
            out = session.tokens(step, done.result.num_accepted, done.result.next_token,
                                 done.seconds, done.result.path)
            self._record(link, out.drafted, out.accepted, out.emitted - out.accepted,
                         done.seconds, is_round=False)
            if not step.tokens:
                step_s.update(done.seconds)
            await send(out.frame)
            if dry_since is None and not session.hint_ahead():
                dry_since, dry_len = time.perf_counter(), len(session.context)

    async def _halted(self, link: Link, send: Send) -> bool:
        """Whether a generation under way ends before its next step: nobody is listening
        any more, or the server is draining (the edge is told)."""
        if link.inbox.ended:
            return True
        if self.draining:
            link.session.stream = None
            await send(link.error(draining_error(), -1))
            return True
        return False

    def _record(self, link: Link, drafted: int, accepted: int, generated: int,
                seconds: float, is_round: bool) -> None:
        """Count one verification pass of ``link``'s (see :meth:`Metrics.record_pass`)."""
        self.metrics.record_pass(drafted, accepted, generated, seconds, is_round)
        link.drafted += drafted
        link.accepted += accepted

    async def _verify(self, link: Link, request: VerifyRequest) -> Pass | bytes:
        """Run ``request`` on the link's KV cache (allocated here, the one place that
        does): the pass, or the error frame to answer when it failed."""
        self._cap_kv(link, len(request.context) + len(request.tokens) + 1)
        if link.sequence is None:  # first use, or evicted: rebuilt from the context
            link.sequence = self._backend.new_sequence()
        link.busy = True
        try:
            return await self.scheduler.verify(link.sequence, request)
        except VerificationError as exc:
            link.sequence = None  # the failed pass may have left the cache half-updated
            return link.error(VerificationFailed(
                f"the server could not verify this draft ({exc}); the session is still "
                f"open, so send the next draft, or report this to the server's operator"),
                request.seq)
        finally:
            link.busy = False
            link.last_used = time.monotonic()

    def _cap_kv(self, link: Link, tokens_needed: int) -> None:
        """Free the KV caches of the least recently used idle sessions until the total,
        with ``tokens_needed`` more for ``link``, fits ``max_kv_bytes``. An evicted
        session keeps its place: its next round re-prefills from its context."""
        cap, per_token = self.policy.max_kv_bytes, self.backend.kv_bytes_per_token
        if not cap or not per_token:
            return
        total = (self.kv_tokens() - link.kv_tokens + tokens_needed) * per_token
        idle = sorted((other for other in self.links
                       if other is not link and not other.busy and other.sequence is not None),
                      key=lambda other: other.last_used)
        for victim in idle:
            if total <= cap:
                break
            total -= victim.kv_tokens * per_token
            victim.sequence = None
            self.kv_evictions += 1
            self.metrics.kv_evictions.inc()
            log.info("evicted a KV cache", extra={"session": victim.session.session_id})

    # -- bookkeeping ---------------------------------------------------------------------
    def release(self, link: Link, ending: Ending = Ending.CLIENT_LEFT) -> None:
        link.session.state, link.session.stream = State.CLOSED, None
        link.sequence = None  # frees the KV cache
        if link in self.links:
            self.links.discard(link)
            self.errors.update(link.session.errors)
            log.info("session closed", extra={
                "session": link.session.session_id, "ending": ending.value,
                "errors": dict(link.session.errors), "sessions": len(self.links)})
        if ending is Ending.IDLE:
            self.evicted_idle += 1

    def kv_tokens(self) -> int:
        return sum(link.kv_tokens for link in list(self.links))

    def tokenizer_bundle(self) -> bytes | None:
        """The target's tokenizer for edges whose draft has another (None: the target's
        cannot be exported); built on first request."""
        if self._bundle is None:
            self._bundle = bundle.pack(self.backend.tokenizer, self.backend.vocab_size) or b""
        return self._bundle or None

    def alive(self) -> bool:
        """Whether the engine can still serve (``/healthz``); the built-in one always can."""
        return True

    def ready(self) -> bool:
        return self.alive() and not self.draining and len(self.links) < self.policy.max_sessions

    def status(self) -> dict[str, object]:
        per_token = self.backend.kv_bytes_per_token
        links = list(self.links)
        return {
            "sessions": len(links),
            "lossy_sessions": sum(link.session.lossy for link in links),  # threshold mode
            "max_sessions": self.policy.max_sessions,
            "kv_tokens": self.kv_tokens(),
            "kv_bytes": self.kv_tokens() * per_token,
            "kv_bytes_by_session": {link.session.session_id: link.kv_tokens * per_token
                                    for link in links},
            # accepted of drafted tokens, for each session that has sent a draft or hint
            "acceptance_by_session": {link.session.session_id:
                                      round(link.accepted / link.drafted, 3)
                                      for link in links if link.drafted},
            "evicted_idle": self.evicted_idle,
            "kv_evictions": self.kv_evictions,
            "errors": dict(sum((link.session.errors for link in links), self.errors)),
            "uptime_s": round(time.time() - self.started, 1),
            "engine": self.name,
            "model": self.backend.description,
        }

    def close(self) -> None:
        for link in list(self.links):
            self.release(link)
        self._stop_model()

    def _stop_model(self) -> None:
        """Stop what runs the target (here: the scheduler and its worker thread)."""
        self.scheduler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
