"""The cloud's one service: every transport feeds frames into it and sends what it answers.

:class:`CloudService` owns the session limits, every open :class:`Link` (a
:class:`~spececd.protocol.cloud_session.CloudSession` and the frames that arrived for it),
draining, idle eviction, the metrics and the one loop that runs a cloud-only generation
(stream drafting). Model work is a :class:`~spececd.cloud.runner.ModelRunner`'s: the
built-in one (:mod:`spececd.cloud.builtin`) or vLLM (:mod:`spececd.cloud.vllm`), put under
the service by :mod:`spececd.cloud.runners`; this module imports neither. The service calls
the runner; the runner never calls the service, and returns what a pass or a step produced,
which only the service writes into the session. A transport does three things and nothing
else::

    link = service.open()                 # a client connected
    link.put(frame) ... link.end()        # from its reader, as frames arrive
    ending = await service.serve(link, send)   # awaits send(reply) for every answer

``serve`` handles the link's frames in order until the client leaves, the session closes
or it idles out, and says which (:class:`Ending`). The in-process transport drives the
same loop on a background event loop, so in-process runs batch and stream-draft like
networked ones. A failed model request answers a typed ``verification_failed`` error;
nothing here raises at a transport for anything a client sent.

A runner that is gone for good (:meth:`ModelRunner.alive` false after a failure) fails
the service: every connected edge gets a fatal ``engine_failed`` error naming the cause,
new ones are refused the same way, :attr:`CloudService.failed` is set and the server
exits non-zero after its drain (``spececd serve``), for a supervisor to restart it.
:meth:`CloudService.check` runs one short generation, so that a server whose engine
cannot generate says so before it says it is serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections import Counter
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass

from spececd.backends import bundle
from spececd.backends.base import tokenizer_fingerprint
from spececd.cloud.inbox import Inbox
from spececd.cloud.metrics import Metrics
from spececd.cloud.runner import EngineStep, Generation, ModelRunner, Pass, RunnerError, Target
from spececd.core.params import Constraint
from spececd.core.policy import Ema
from spececd.core.verify import tree_depth
from spececd.errors import InputError
from spececd.grammar import grammars_for, warm
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import (
    CloudSession,
    GenerateRequest,
    Limits,
    State,
    StepOut,
    VerifyRequest,
)
from spececd.protocol.errors import (
    Draining,
    EngineFailed,
    ProtocolError,
    ServerBusy,
    VerificationFailed,
)

log = logging.getLogger(__name__)

__all__ = ["CloudService", "Ending", "Inbox", "Limits", "Link", "Send", "ServicePolicy",
           "Target", "draining_error"]

Send = Callable[[bytes], Awaitable[None]]


class Ending(enum.Enum):
    """Why :meth:`CloudService.serve` returned; transports map it to their own close codes."""

    CLIENT_LEFT = "client_left"  # the link ended (the client closed or dropped it)
    CLOSED = "closed"  # the session closed: a Close frame, or a fatal error was answered
    IDLE = "idle"  # no frame within the idle timeout
    REFUSED = "refused"  # the server was full; the error frame was sent
    DRAINED = "drained"  # the server is shutting down; the draining error was sent


@dataclass(frozen=True)
class ServicePolicy:
    """The service's limits on sessions (the runner's are in
    :class:`~spececd.cloud.runner.RunnerConfig`, the listeners' in
    :class:`~spececd.transports.registry.Listener`)."""

    max_sessions: int = 64
    idle_timeout: float = 300.0  # seconds without a frame before a session is evicted


def draining_error() -> Draining:
    """What a draining server answers new sessions, new rounds and streams under way."""
    return Draining("the server is shutting down; reconnect (through a balancer: to "
                    "another replica) and re-send the history")


class Link:
    """One client's session on the service: its state machine and the frames that arrived.
    What the runner holds for it (a KV cache, a request) is kept under :attr:`key`."""

    def __init__(self, service: CloudService, refusal: bytes = b"",
                 authorized: bool = False) -> None:
        # ``authorized``: the transport checked the token already, so the hello needs none.
        self.session = CloudSession(service.fingerprint, service.limits,
                                    "" if authorized else service.auth_token,
                                    service.target.tree_attention, service.runner.unsupported,
                                    service.constraint_error)
        self.inbox = Inbox()
        self.refusal = refusal  # the error frame to send instead of serving
        self.drafted = 0  # drafted tokens verified for this session, and accepted
        self.accepted = 0
        self._metrics = service.metrics
        self._reported: Counter[str] = Counter()  # errors already counted in the metrics

    @property
    def key(self) -> str:
        """The session's id, under which the runner keeps what it holds for it."""
        return self.session.session_id

    def put(self, frame: bytes) -> None:
        """A frame arrived from the client (the transport's reader calls this)."""
        self.inbox.put(frame)

    def end(self) -> None:
        """No more frames will come; :meth:`CloudService.serve` returns after answering
        the frames queued."""
        self.inbox.end()

    def leave(self) -> None:
        """The client is gone: :meth:`CloudService.serve` drops what it has not answered
        (a round waiting for its pass included) and returns."""
        self.inbox.leave()

    @property
    def closed(self) -> bool:
        """Whether the session has closed (a Close frame, or a fatal error answered)."""
        return self.session.state is State.CLOSED

    def receive(self, frame: bytes) -> None:
        """Run one frame through the session (cheap: no model work)."""
        self.session.receive_data(frame)

    def error(self, exc: ProtocolError, seq: int = -1) -> None:
        """Queue ``exc`` as an error frame for the request ``seq`` (-1: none)."""
        self.session.send_error(exc, seq)

    async def flush(self, send: Send) -> None:
        """Send what the session queued, counting the errors among it in the metrics."""
        if self.session.errors != self._reported:
            for code, n in (self.session.errors - self._reported).items():
                self._metrics.errors.labels(code).inc(n)
                log.warning("rejected a frame: %s", code, extra={
                    "session": self.key, "request": self.session.request_seq, "code": code})
            self._reported = Counter(self.session.errors)
        for frame in self.session.data_to_send():
            await send(frame)


class CloudService:
    """See the module docstring. ``metrics``: the registry the runner reports into too
    (a new one when None)."""

    def __init__(self, runner: ModelRunner, limits: Limits | None = None,
                 policy: ServicePolicy | None = None, auth_token: str = "",
                 metrics: Metrics | None = None) -> None:
        limits = limits or Limits()
        self.runner = runner
        self.target: Target = runner.target
        widths = [w for w in (limits.pass_width, runner.width) if w > 0]
        self.limits = dataclasses.replace(
            limits, max_context=min(limits.max_context, self.target.max_context),
            pass_width=min(widths, default=0))
        self.policy = policy or ServicePolicy()
        self.fingerprint = tokenizer_fingerprint(self.target.tokenizer, self.target.vocab_size)
        self._bundle: bytes | None = None
        self.draining = False  # shutting down: no new sessions or rounds (drain())
        self.failure = ""  # why the runner is gone for good ("": it is not); see fail()
        self.failed = asyncio.Event()  # set with failure: the server drains and exits
        self._last_error = ""  # the last failed model request's cause, for check()
        self.auth_token = auth_token
        self.metrics = metrics or Metrics()
        self.links: set[Link] = set()
        self.started = time.time()
        self.evicted_idle = 0
        self.errors: Counter[str] = Counter()  # by error code, of released sessions
        self.metrics.active_sessions.set_function(lambda: len(self.links))
        self.metrics.kv_bytes.set_function(
            lambda: self.kv_tokens() * self.target.kv_bytes_per_token)
        # the first constraint: no set-up
        self._grammar_warm = warm(self.target.tokenizer, self.target.vocab_size)

    @property
    def name(self) -> str:
        """The runner's name, as ``spececd serve --engine`` gives it."""
        return self.runner.name

    def refusal(self) -> ProtocolError:
        """What a server that is shutting down answers new sessions, new rounds and streams
        under way: ``engine_failed`` naming the cause when the runner failed, else
        ``draining``."""
        if self.failure:
            return EngineFailed(
                f"the server's {self.name} engine failed ({self.failure}); the server is "
                f"exiting for its supervisor to restart it, so this session cannot go on "
                f"here: report this to the server's operator")
        return draining_error()

    def fail(self, cause: str) -> None:
        """The runner is gone for good: refuse everything with ``engine_failed`` naming
        ``cause``, wake every link so that each gets it now, and set :attr:`failed`."""
        if self.failure:
            return
        self.failure = cause or "no cause given"
        self.draining = True
        log.critical("the %s runner has failed (%s): every session gets an engine_failed "
                     "error, /healthz and /readyz answer 503; restart the server",
                     self.runner.name, self.failure)
        for link in list(self.links):
            link.inbox.wake()
        self.failed.set()

    async def check(self, timeout: float = 600.0) -> None:
        """One short generation through the runner, the way an edge's runs; raises
        :class:`~spececd.protocol.errors.EngineFailed` naming the cause when it fails
        (a model the engine loads but cannot run, e.g. a head size its attention
        refuses) or takes longer than ``timeout`` seconds."""
        prompt = tuple(self.target.tokenizer.encode("Hello")[:4]) or (0,)
        hello = m.Hello(m.PROTOCOL_VERSION, self.fingerprint, "match", 0.0, 0, 1.0, 0)
        replies: list[m.Message] = []
        link = self.open(authorized=True)
        link.put(m.encode(hello))
        link.put(m.encode(m.Generate(1, 0, prompt, 2)))

        async def send(frame: bytes) -> None:
            reply = m.decode(frame)
            replies.append(reply)
            if isinstance(reply, m.Error) or (isinstance(reply, m.Tokens) and reply.done):
                link.end()

        try:
            await asyncio.wait_for(self.serve(link, send), timeout)
        except asyncio.TimeoutError:  # not TimeoutError itself before Python 3.11
            raise EngineFailed(f"the {self.name} engine did not generate 2 tokens within "
                               f"{timeout:g} s") from None
        errors = [reply for reply in replies if isinstance(reply, m.Error)]
        if errors or not any(isinstance(r, m.Tokens) and r.done for r in replies):
            cause = self.failure or self._last_error or (
                errors[0].message if errors else "it ended the generation early")
            raise EngineFailed(f"the {self.name} engine cannot generate with "
                               f"{self.target.description}: {cause}")
        log.info("engine check passed: the %s engine generated", self.name)

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
            error: ProtocolError = self.refusal()
            return Link(self, m.encode(m.Error(error.code, str(error), -1, True)))
        if len(self.links) >= self.policy.max_sessions:
            error = ServerBusy(f"the server holds its maximum of {self.policy.max_sessions} "
                               f"sessions; try again later")
            self.metrics.errors.labels(error.code).inc()
            return Link(self, m.encode(m.Error(error.code, str(error), -1, True)))
        link = Link(self, authorized=authorized)
        self.links.add(link)
        log.info("session opened", extra={"session": link.key, "sessions": len(self.links)})
        return link

    async def run(self, link: Link, frames: AsyncIterable[bytes], send: Send, *,
                  half_close: bool = False) -> Ending:
        """:meth:`serve` ``link`` while a task puts every frame of ``frames`` (a
        transport's incoming stream) into it. The stream's end means the client left
        (a closed connection), unless the transport lets a client end its input and go on
        reading (``half_close``: a gRPC stream), where it only ends the input."""

        async def read() -> None:
            try:
                async for frame in frames:
                    link.put(frame)
            finally:
                if half_close:
                    link.end()
                else:
                    link.leave()

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
                if frame is None or link.inbox.left:  # (a gone client reads no answer)
                    return ending
                if self.draining:  # new work goes to another replica
                    link.error(self.refusal())
                    await link.flush(send)
                    ending = Ending.DRAINED
                    return ending
                await self._precompile(link, frame)
                link.receive(frame)
                await self._answer(link, send)
                if link.closed:
                    ending = Ending.CLOSED
                    return ending
        finally:
            self.release(link, ending)

    # -- constraints ---------------------------------------------------------------------
    def constraint_error(self, constraint: Constraint) -> str:
        """Why ``constraint`` cannot be compiled for the target's tokenizer ("" when it
        can; then it is in the cache, for the runner)."""
        try:
            grammars_for(self.target.tokenizer, self.target.vocab_size).compile(constraint)
        except InputError as exc:
            return str(exc)
        return ""

    async def _precompile(self, link: Link, frame: bytes) -> None:
        """Compile an authorized hello's constraint off the event loop (within the compile
        time limit), so that the session's check of it finds it cached and other sessions
        go on. An unauthorized one costs nothing: its session refuses it."""
        # A hello is a msgpack array of at most 15 fields whose first is its type.
        if len(frame) < 2 or frame[0] & 0xF0 != 0x90 or frame[1] != m.Hello.TYPE:
            return
        try:
            hello = m.decode(frame)
        except ProtocolError:
            return  # the session answers it
        if (isinstance(hello, m.Hello) and hello.constraint is not None
                and link.session.authorizes(hello.auth_token)):
            await asyncio.get_running_loop().run_in_executor(
                None, self.constraint_error, hello.constraint)

    # -- running what a session asks -----------------------------------------------------
    async def _answer(self, link: Link, send: Send) -> None:
        """Send what the session queued, and run the requests it received (a generation
        may take further frames, whose requests then run here after it), until none is
        left."""
        await link.flush(send)
        while events := link.session.events_received():
            for event in events:
                if isinstance(event, VerifyRequest):
                    await self._round(link, event)
                else:
                    await self._generate(link, event, send)
                await link.flush(send)

    async def _verify(self, link: Link, request: VerifyRequest) -> Pass | None:
        """The runner's pass for ``request``; None when the client is gone before it
        ran: a queued pass is dropped, a running one's result discarded (and the runner's
        cache for the session with it), so that vanished clients cost the others no pass.
        Raises the runner's :class:`RunnerError`."""
        verify = asyncio.ensure_future(self.runner.verify(link.key, request))
        gone = asyncio.ensure_future(link.inbox.gone())
        try:
            await asyncio.wait({verify, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not verify.done():
                verify.cancel()
                await asyncio.gather(verify, return_exceptions=True)
        if verify.cancelled():
            self.metrics.abandoned.inc()
            log.info("client gone before its pass: dropped", extra={"session": link.key})
            return None
        return verify.result()

    async def _round(self, link: Link, request: VerifyRequest) -> None:
        """Verify one draft and queue its verdict (or the error; nothing when the client
        is gone before its pass)."""
        try:
            done = await self._verify(link, request)
        except RunnerError as exc:
            self._failed(link, request.seq, exc)
            return
        if done is None:
            return
        drafted = len(request.tokens) if request.parents is None else tree_depth(request.parents)
        if done.verified >= 0:  # the budget cut the draft: what was verified counts
            drafted = min(drafted, done.verified)
        self._record(link, drafted, done.result.num_accepted, 1, done.seconds,
                     is_round=True)  # a tree counts its positions
        link.session.verdict(request, done.result.num_accepted, done.result.next_token,
                             done.seconds, done.result.path, done.logprobs,
                             done.prompt_logprobs, done.budget, done.verified)

    async def _generate(self, link: Link, request: GenerateRequest, send: Send) -> None:
        """A cloud-only generation, one ``Tokens`` frame per step, on any runner.

        Frames that arrive meanwhile go through the session: hints feed the generation,
        anything else may end or replace it (its request then runs after this returns).
        A runner with a generation of its own (vLLM) takes them while a step runs; without
        one (built-in), they are taken between steps, and there, when the hint has run dry
        (the target contradicted it, or used it up), the next step waits for a fresh one if the edge
        has been answering faster than a step takes, and otherwise generates a token of
        its own without waiting.

        The edge's turnaround is measured from the step that left no hint to the arrival
        of the next hint reaching past what that step generated, whether the hint then
        agrees or not: an edge whose hints all come too late must still be measured, or
        the server would never wait for them and they would stay too late."""
        session = link.session
        stream = session.stream
        if stream is None or stream.request is not request:
            return  # already ended (a fatal error was answered with it)
        generation = self.runner.generation(link.key, request, stream.hint_start, stream.hint)
        turnaround, step_s = Ema(0.0, weight=0.3), Ema(0.0, weight=0.3)
        dry_since: float | None = time.perf_counter()
        dry_len = len(session.context)  # the context when the hint ran dry

        def take() -> bool:
            """Run the frames that have arrived through the session, in order, until one
            ends the generation (the rest stay queued); whether it goes on."""
            nonlocal dry_since
            while (item := link.inbox.poll()) is not None:
                arrived, data = item
                link.receive(data)
                if session.stream is not stream:
                    return False  # closed, or replaced by a new hello, generate or draft
                if generation is not None:
                    generation.hinted(stream.hint_start, stream.hint)
                if dry_since is not None and stream.reach > dry_len:
                    turnaround.update(arrived - dry_since)
                    dry_since = None
            return True

        try:
            while session.stream is stream:
                if link.inbox.ended:
                    return  # nobody is listening any more
                if self.draining:
                    session.stream = None
                    link.error(self.refusal())
                    return
                if (generation is None and dry_since is not None
                        and turnaround.seen and step_s.seen
                        and turnaround.value < step_s.value):
                    wait = dry_since + min(step_s.value, 1.5 * turnaround.value)
                    await link.inbox.wait(wait - time.perf_counter())
                if not take():
                    return
                out = await self._step(link, generation, take)
                if out is None:
                    continue  # the loop's checks say why (failed, ended, left, draining)
                if not out.drafted:
                    step_s.update(out.seconds)
                await link.flush(send)
                if dry_since is None and not session.hint_ahead():
                    dry_since, dry_len = time.perf_counter(), len(session.context)
        finally:
            if generation is not None:
                await generation.close()

    async def _step(self, link: Link, generation: Generation | None,
                    take: Callable[[], bool]) -> StepOut | None:
        """One step of the generation, recorded in the session (which queues its
        ``Tokens`` frame) and the metrics; None when it failed (the error is queued), or
        when, during a runner's own step, a frame taken ended the generation, the client
        left or the server began draining (the step is then abandoned: the caller looks
        again). Without a generation of the runner's own, a step verifies the hint ahead of
        the context; a runner's own step runs beside the frames arriving."""
        session = link.session
        seq = session.stream.request.seq if session.stream is not None else -1
        ended_early = False  # the engine ended the generation before SpecECD's own limits
        try:
            if generation is None:
                request = session.stream_step()
                done = await self._verify(link, request)
                if done is None:
                    return None
                result = done.result
                out = session.tokens(request, result.num_accepted, result.next_token,
                                     done.seconds, result.path, done.logprobs,
                                     done.prompt_logprobs, done.budget, done.verified)
            else:
                step = await self._engine_step(link, generation, take)
                if step is None:
                    return None
                out = session.engine_tokens(step.tokens, step.seconds)
                ended_early = step.finished and not out.done
        except RunnerError as exc:
            session.stream = None
            self._failed(link, seq, exc)
            return None
        self._record(link, out.drafted, out.accepted, out.emitted - out.accepted, out.seconds,
                     is_round=False)
        if ended_early:
            session.stream = None
            self._failed(link, seq, RunnerError("the engine ended the generation early"))
            return None
        return out

    async def _engine_step(self, link: Link, generation: Generation,
                           take: Callable[[], bool]) -> EngineStep | None:
        """A runner's own step, run as a task while the frames arriving are taken (hints
        reach the runner as they come); None when one ended the generation, the client
        left or the server began draining."""
        step = asyncio.ensure_future(generation.step())
        try:
            while not step.done():
                arrival = asyncio.ensure_future(link.inbox.arrived())
                await asyncio.wait({step, arrival}, return_when=asyncio.FIRST_COMPLETED)
                arrival.cancel()
                if step.done():
                    break  # recorded first; what arrived is taken before the next step
                if not take() or link.inbox.ended or self.draining:
                    return None
            return await step
        finally:
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)

    def _failed(self, link: Link, seq: int, exc: BaseException) -> None:
        """Answer a failed model request: the session stays open unless the runner is
        gone, in which case the service fails (:meth:`fail`)."""
        # The runner logged the failure's traceback where it caught it (the scheduler, vLLM's
        # request); this line ties it to the session.
        log.error("a model request failed: %s", exc, extra={"session": link.key})
        self._last_error = str(exc)
        if not self.runner.alive():
            self.fail(str(exc))
            link.error(self.refusal(), seq)
            return
        link.error(VerificationFailed(
            f"the server could not run this request ({exc}); the session is still open, so "
            f"send the next request, or report this to the server's operator"), seq)

    def _record(self, link: Link, drafted: int, accepted: int, generated: int,
                seconds: float, is_round: bool) -> None:
        """Count one verification pass of ``link``'s (see :meth:`Metrics.record_pass`)."""
        self.metrics.record_pass(drafted, accepted, generated, seconds, is_round)
        link.drafted += drafted
        link.accepted += accepted

    # -- bookkeeping ---------------------------------------------------------------------
    def release(self, link: Link, ending: Ending = Ending.CLIENT_LEFT) -> None:
        """Close ``link``'s session, have the runner free what it holds for it, and count
        how it ended; idempotent."""
        link.session.state, link.session.stream = State.CLOSED, None
        self.runner.forget(link.key)  # frees the KV cache
        if link in self.links:
            self.links.discard(link)
            self.errors.update(link.session.errors)
            log.info("session closed", extra={
                "session": link.key, "ending": ending.value,
                "errors": dict(link.session.errors), "sessions": len(self.links)})
        if ending is Ending.IDLE:
            self.evicted_idle += 1

    def kv_tokens(self) -> int:
        """Tokens of KV cache the runner holds for the open sessions."""
        return sum(self.runner.kv_tokens(link.key) for link in list(self.links))

    def tokenizer_bundle(self) -> bytes | None:
        """The target's tokenizer for edges whose draft has another (None: the target's
        cannot be exported); built on first request."""
        if self._bundle is None:
            self._bundle = bundle.pack(self.target.tokenizer, self.target.vocab_size) or b""
        return self._bundle or None

    def alive(self) -> bool:
        """Whether the service can still serve (``/healthz``): its runner is alive."""
        return self.runner.alive()

    def ready(self) -> bool:
        """Whether a new session would be taken (``/readyz``): alive, not draining, and
        below the session limit."""
        return self.alive() and not self.draining and len(self.links) < self.policy.max_sessions

    def status(self) -> dict[str, object]:
        per_token = self.target.kv_bytes_per_token
        links = list(self.links)
        return {
            "sessions": len(links),
            "lossy_sessions": sum(link.session.lossy for link in links),  # threshold mode
            "max_sessions": self.policy.max_sessions,
            "kv_tokens": self.kv_tokens(),
            "kv_bytes": self.kv_tokens() * per_token,
            "kv_bytes_by_session": {link.key: self.runner.kv_tokens(link.key) * per_token
                                    for link in links},
            # accepted of drafted tokens, for each session that has sent a draft or hint
            "acceptance_by_session": {link.key: round(link.accepted / link.drafted, 3)
                                      for link in links if link.drafted},
            "evicted_idle": self.evicted_idle,
            "kv_evictions": 0,
            **self.runner.status(),
            "errors": dict(sum((link.session.errors for link in links), self.errors)),
            "tasks": _tasks(),  # the server loop's asyncio tasks (a leak grows them)
            "uptime_s": round(time.time() - self.started, 1),
            "engine": self.name,
            "model": self.target.description,
        }

    def close(self) -> None:
        for link in list(self.links):
            self.release(link)
        try:
            self.runner.close()
        finally:
            self._grammar_warm.join()


def _tasks() -> int | None:
    """The running event loop's tasks, or None off any loop."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return None
