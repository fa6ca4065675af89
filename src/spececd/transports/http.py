"""HTTP/JSON transport: SpecECD over plain HTTP/1.1 with keep-alive, both sides.

Server: :func:`serve` puts an :class:`~spececd.cloud.engine.Engine` behind uvicorn. One
port answers three kinds of client:

- the edge's own transport, SpecECD frames over HTTP (``/v1/links``). ``POST /v1/links``
  opens an engine link, served like a WebSocket connection; ``POST .../frames`` carries
  one binary frame and answers with every reply queued so far, after waiting up to
  ``wait`` seconds for one, so a draft costs one exchange; ``GET .../frames`` long-polls
  for more; ``DELETE`` ends the link. Frames are numbered (``n``) and replies
  acknowledged (``ack``), so a request retried on a new connection is neither applied
  nor answered twice. A link that ended (closed, idle, refused) answers 404: the edge
  opens a new one and re-sends its history.
- clients with their own drafter, in the seed's JSON shape (``/v1/sessions``): create a
  session with its sampling parameters, ``prefill`` token ids, ``verify`` drafts, delete.
  The server keeps each session's history and verifies through
  :class:`~spececd.cloud.unary.UnarySessions`, which reuses the target's KV cache.
- operators: ``/healthz``, ``/readyz`` (503 when full), ``/status``, ``/metrics``, and the
  OpenAPI schema at ``/openapi.json`` (a docs page at ``/docs``).

Every ``/v1`` endpoint needs ``Authorization: Bearer TOKEN`` when the engine has a token
(frames carry it in their hello as well, checked by the session). Every error is
``{"error": {"code": ..., "message": ...}}`` with a code from
:mod:`spececd.protocol.errors` and a status for its kind: 400 malformed or invalid, 401
auth, 404 unknown session or link, 409 out of order, 413 over a limit (a body over
``max_message_bytes`` is refused unread), 500 verification failed, 503 busy.

Client: :class:`HttpTransport`, the edge's blocking transport for ``http://`` and
``https://`` URLs, on the standard library's ``http.client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http.client
import io
import json
import secrets
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from email.message import Message
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import numpy as np
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from spececd.cloud.engine import Engine, Link
from spececd.cloud.unary import UnaryParams, UnarySessions
from spececd.core.sampling import SparseProbs
from spececd.protocol import messages as m
from spececd.protocol.errors import (
    AuthFailed,
    InvalidProbabilities,
    LimitExceeded,
    OutOfOrder,
    ProtocolError,
    ServerBusy,
    UnknownSession,
    VerificationFailed,
    error_for_code,
)
from spececd.transports.tls import client_ssl_context

MAX_WAIT = 60.0  # seconds a request may wait for a reply; clients long-poll again after
GRACE = 30.0  # seconds an ended link keeps replies nobody fetched yet
KEEP_ALIVE = 75  # seconds the server keeps an idle connection open
FIRST_REPLY = "SpecECD-First-Reply"  # header: the number of the first reply in a response

# -- errors ---------------------------------------------------------------------------

_STATUS = {AuthFailed.code: 401, UnknownSession.code: 404, OutOfOrder.code: 409,
           LimitExceeded.code: 413, VerificationFailed.code: 500, ServerBusy.code: 503}


def status_for(code: str) -> int:
    """The HTTP status for a protocol error code (400 unless it names another kind)."""
    return _STATUS.get(code, 400)


class HttpError(HTTPException):
    """A protocol error this module found itself (not one the engine answered): answered
    like every error, and counted in the engine's metrics."""

    def __init__(self, error: ProtocolError) -> None:
        super().__init__(status_for(error.code), str(error))
        self.code = error.code


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def error_response(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else \
        {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(code, message), status, headers)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 with a typed
    ``limit_exceeded`` error, before it is read when it declares its length, else as soon
    as it has grown past the limit."""

    def __init__(self, app: ASGIApp, limit: int, engine: Engine) -> None:
        self.app, self.limit, self.engine = app, limit, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            self.engine.metrics.errors.labels(LimitExceeded.code).inc()
            await error_response(413, LimitExceeded.code, self._message(declared))(
                scope, receive, send)
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HttpError(LimitExceeded(self._message(b"more")))
            return message

        await self.app(scope, limited, send)

    def _message(self, declared: bytes) -> str:
        return (f"a body of {declared.decode(errors='replace')[:20]} bytes is over the "
                f"limit of {self.limit}")


# -- the JSON API's shapes ------------------------------------------------------------

TokenId = Annotated[int, Field(ge=0, lt=2**32, description="a token id of the target's "
                                                         "vocabulary")]


class ErrorDetail(BaseModel):
    code: str = Field(description="a code from SpecECD's error tree, e.g. invalid_tokens")
    message: str = Field(description="what was wrong and what to do")


class ErrorBody(BaseModel):
    error: ErrorDetail


class LinkCreated(BaseModel):
    link_id: str = Field(description="the link's id: unguessable, used in its URLs")


class SessionParams(BaseModel):
    """A JSON session's verification mode and sampling parameters, applied by the target
    exactly as the client's drafter applies them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["exact", "match", "greedy"] = Field(
        "match", validation_alias=AliasChoices("mode", "strategy"),
        description="exact (rejection sampling; needs draft_probs), match (keep drafted "
                    "tokens while they equal the target's own samples) or greedy; at "
                    "temperature 0 every mode is greedy. Also accepted as `strategy`.")
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, lt=2**31, description="0 disables it")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 disables it")
    seed: int = Field(0, ge=0, lt=2**63, description="seeds the verifier's random stream")


class SessionCreated(BaseModel):
    session_id: str
    mode: str = Field(description="the mode in effect (greedy at temperature 0)")
    max_draft: int = Field(description="drafted tokens per verify, at most")
    max_context: int = Field(description="tokens of history, drafts included, at most")


class PrefillBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    token_ids: list[TokenId] = Field(min_length=1, description="tokens appended to the "
                                     "session's history (the prompt, or a new turn)")


class Prefilled(BaseModel):
    total_tokens: int = Field(description="the history's length")


class SparseDistribution(BaseModel):
    """The distribution one drafted token was sampled from, over its support."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ids: list[TokenId] = Field(min_length=1)
    probs: list[float] = Field(min_length=1, description="one per id, summing to 1")

    @model_validator(mode="after")
    def _same_length(self) -> SparseDistribution:
        if len(self.ids) != len(self.probs):
            raise ValueError("ids and probs must have the same length")
        return self


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    draft_tokens: list[TokenId] = Field(description="drafted tokens continuing the history "
                                        "(may be empty: the target adds one of its own)")
    draft_probs: list[SparseDistribution] | None = Field(
        None, description="one distribution per drafted token: required in exact mode, "
                          "ignored in the others")


class Verified(BaseModel):
    accepted_prefix_len: int = Field(description="drafted tokens kept, from the first")
    preds: list[int] = Field(description="the tokens appended to the history: the kept "
                             "drafted tokens, then the target's own")
    next_token: int = Field(description="the target's own token: the correction at the "
                            "first rejected position, or the bonus after a fully kept draft")
    total_tokens: int = Field(description="the history's length")
    verify_ms: float = Field(description="the target pass's time")


# -- server state ---------------------------------------------------------------------


class FrameLink:
    """One edge link over HTTP: an engine link served in a task, and its replies from
    number ``first`` on (those before were acknowledged)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.frames = 0  # frames received: the number the next one must carry
        self.first = 0
        self.replies: list[bytes] = []
        self.handed = 0  # replies handed out: what a request without ``ack`` acknowledges
        self.ended = False
        self.task: asyncio.Task[object] | None = None
        self._event = asyncio.Event()

    async def send(self, frame: bytes) -> None:  # the engine's ``send``
        self.replies.append(frame)
        self.wake()

    def wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()  # for the next waiters

    def put(self, frame: bytes, n: int | None) -> None:
        """Hand frame number ``n`` (None: the next) to the engine, once."""
        if n is None or n == self.frames:
            self.link.put(frame)
            self.frames += 1
        elif n > self.frames:
            raise HttpError(OutOfOrder(f"frame {n} does not follow frame {self.frames - 1}; "
                                       f"re-send from frame {self.frames}"))
        # else a retransmission of a frame the engine has: answered, not applied again

    async def answer(self, ack: int | None, wait: float) -> tuple[int, list[bytes]]:
        """Drop the replies before ``ack``; return the number of the first reply after and
        every reply from there, waiting up to ``wait`` seconds for one if there is none."""
        ack = self.handed if ack is None else ack
        if ack > self.first + len(self.replies):
            raise HttpError(OutOfOrder(f"ack {ack} is past the {self.first + len(self.replies)}"
                                       f" replies sent"))
        done = max(0, ack - self.first)
        del self.replies[:done]
        self.first += done
        if not self.replies and not self.ended and wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError before 3.11
                await asyncio.wait_for(self._event.wait(), wait)
        if not self.replies and self.ended:
            raise HttpError(UnknownSession("the link ended (closed, refused or idle); open "
                                           "a new link and re-send the history"))
        self.handed = self.first + len(self.replies)
        return self.first, list(self.replies)


@dataclass
class JsonSession:
    params: UnaryParams
    history: list[int] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def exact(self) -> bool:
        return self.params.mode == "exact" and self.params.temperature > 0


class Service:
    """Everything the routes do: the frame links and the JSON sessions on one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.unary = UnarySessions(engine)
        self.links: dict[str, FrameLink] = {}
        self.sessions: dict[str, JsonSession] = {}

    # -- frame links --------------------------------------------------------------------
    def open_link(self) -> str:
        link = self.engine.open()
        if link.refusal:  # full: the engine counted the error it would have sent
            refusal = m.decode(link.refusal)
            assert isinstance(refusal, m.Error)
            raise error_for_code(refusal.code, refusal.message)
        link_id = secrets.token_urlsafe(16)
        frame_link = self.links[link_id] = FrameLink(link)
        frame_link.task = asyncio.get_running_loop().create_task(
            self._serve(link_id, frame_link))
        return link_id

    async def _serve(self, link_id: str, frame_link: FrameLink) -> object:
        try:
            return await self.engine.serve(frame_link.link, frame_link.send)
        finally:
            frame_link.ended = True
            frame_link.wake()
            asyncio.get_running_loop().call_later(GRACE, self.links.pop, link_id, None)

    def link(self, link_id: str, sending: bool = False) -> FrameLink:
        frame_link = self.links.get(link_id)
        if frame_link is None or (sending and frame_link.ended):
            raise HttpError(UnknownSession("no such link (it ended: closed, refused or "
                                           "idle); open a new link and re-send the history"))
        return frame_link

    def close_link(self, link_id: str) -> None:
        self.link(link_id).link.end()
        self.links.pop(link_id, None)

    # -- JSON sessions ------------------------------------------------------------------
    def create_session(self, params: SessionParams) -> SessionCreated:
        self._expire()
        limit = self.engine.policy.max_sessions
        if len(self.sessions) >= limit or not self.engine.ready():
            raise HttpError(ServerBusy(f"the server holds its maximum of {limit} sessions; "
                                       f"try again later"))
        session_id = secrets.token_urlsafe(16)
        unary = UnaryParams(params.mode, params.temperature, params.top_k, params.top_p,
                            params.seed)
        self.sessions[session_id] = JsonSession(unary)
        limits = self.engine.limits
        return SessionCreated(session_id=session_id,
                              mode="greedy" if params.temperature == 0 else params.mode,
                              max_draft=limits.max_draft, max_context=limits.max_context)

    def session(self, session_id: str) -> JsonSession:
        self._expire()
        session = self.sessions.get(session_id)
        if session is None:
            raise HttpError(UnknownSession(
                "no such session (never created, deleted, or idle longer than "
                f"{self.engine.policy.idle_timeout:g} s); create one and prefill its history"))
        session.last_used = time.monotonic()
        return session

    async def prefill(self, session_id: str, token: str, token_ids: Sequence[int]) -> int:
        """Append ``token_ids`` to the history and run the target over them now, so the
        next verify finds them in its KV cache (the target's token after them is not
        kept: its draw depends on the position only, so it changes nothing later)."""
        session = self.session(session_id)
        async with session.lock:
            history = [*session.history, *token_ids]
            await self.unary.verify(session_id, token, session.params, history, (), ())
            session.history = history
            return len(history)

    async def verify(self, session_id: str, token: str, body: VerifyBody) -> Verified:
        session = self.session(session_id)
        draft = body.draft_tokens
        draft_probs: tuple[SparseProbs, ...] | None = None
        if body.draft_probs is not None:
            if len(body.draft_probs) != len(draft):
                raise HttpError(InvalidProbabilities(
                    f"draft_probs has {len(body.draft_probs)} distributions for {len(draft)} "
                    f"drafted tokens; send one per drafted token"))
            draft_probs = tuple(SparseProbs(np.asarray(d.ids, dtype=np.int64),
                                            np.asarray(d.probs, dtype=np.float32))
                                for d in body.draft_probs)
        elif not draft:
            draft_probs = ()
        elif session.exact:
            raise HttpError(InvalidProbabilities(
                "exact mode needs draft_probs: for each drafted token, the sparse "
                "distribution it was sampled from ({ids, probs} over its support); without "
                "it the verdict would be biased. Send them, or create the session with "
                "mode match"))
        async with session.lock:
            if not session.history:
                raise HttpError(OutOfOrder(f"the session holds no tokens yet: POST "
                                           f"/v1/sessions/{session_id}/prefill the prompt "
                                           f"first"))
            verdict = await self.unary.verify(session_id, token, session.params,
                                              session.history, draft, draft_probs)
            preds = [*draft[:verdict.num_accepted], verdict.next_token]
            session.history.extend(preds)
            return Verified(accepted_prefix_len=verdict.num_accepted, preds=preds,
                            next_token=verdict.next_token, total_tokens=len(session.history),
                            verify_ms=round(verdict.verify_s * 1000, 3))

    async def delete_session(self, session_id: str, token: str) -> None:
        if self.sessions.pop(session_id, None) is None:
            raise HttpError(UnknownSession("no such session"))
        await self.unary.close(session_id, token)

    def _expire(self) -> None:
        """Forget the JSON sessions idle longer than the engine's idle timeout."""
        cutoff = time.monotonic() - self.engine.policy.idle_timeout
        for session_id, session in list(self.sessions.items()):
            if session.last_used < cutoff and not session.lock.locked():
                del self.sessions[session_id]  # its engine link idled out as well

    def close(self) -> None:
        for frame_link in self.links.values():
            frame_link.link.end()
        self.unary.close_all()


# -- routes ---------------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="the server's auth token, when it has one")


async def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


async def _token(service: Annotated[Service, Depends(_service)],
           credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
           ) -> str:
    """The bearer token, checked against the engine's (none needed when it has none)."""
    token = credentials.credentials if credentials is not None else ""
    expected = service.engine.auth_token
    if expected and not hmac.compare_digest(token.encode(), expected.encode()):
        raise HttpError(AuthFailed("missing or wrong auth token: send the header "
                                   "`Authorization: Bearer <token>`"))
    return token


ServiceDep = Annotated[Service, Depends(_service)]
TokenDep = Annotated[str, Depends(_token)]
Wait = Annotated[float, Query(ge=0.0, le=MAX_WAIT, description=(
    "seconds to wait for a reply when none is queued"))]
Ack = Annotated[int | None, Query(ge=0, description=(
    "replies the client has received (the number of the next one it wants); default: "
    "every reply handed out before"))]

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description} for status, description in (
        (400, "malformed or invalid (malformed_frame, invalid_tokens, invalid_probabilities"
              ", unexpected_message)"),
        (401, "auth_failed"), (404, "unknown_session"), (409, "out_of_order"),
        (413, "limit_exceeded"), (500, "verification_failed"), (503, "server_busy"))}
_FRAME = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_REPLIES = {200: {"description": (
    f"the replies from number `{FIRST_REPLY}` (a header) on, each a 4-byte big-endian "
    f"length and a frame"), "content": _FRAME}}

v1 = APIRouter(prefix="/v1", responses=_ERRORS)


def _replies(first: int, replies: list[bytes]) -> Response:
    body = b"".join(len(r).to_bytes(4, "big") + r for r in replies)
    return Response(body, media_type="application/octet-stream",
                    headers={FIRST_REPLY: str(first)})


@v1.post("/links", status_code=201, tags=["frames"])
async def create_link(service: ServiceDep, _: TokenDep) -> LinkCreated:
    """Open a link that carries SpecECD's binary frames (the edge's transport)."""
    return LinkCreated(link_id=service.open_link())


@v1.post("/links/{link_id}/frames", tags=["frames"], response_class=Response,
         responses=_REPLIES,  # type: ignore[arg-type]
         openapi_extra={"requestBody": {"required": True, "content": _FRAME}})
async def post_frame(link_id: str, request: Request, service: ServiceDep, _: TokenDep,
                     wait: Wait = 0.0, ack: Ack = None,
                     n: Annotated[int | None, Query(ge=0, description=(
                         "this frame's number on the link, from 0; a number already "
                         "received is answered but not applied again"))] = None) -> Response:
    """Send one frame; answer every reply queued so far."""
    frame_link = service.link(link_id, sending=True)
    frame_link.put(await request.body(), n)
    return _replies(*await frame_link.answer(ack, wait))


@v1.get("/links/{link_id}/frames", tags=["frames"], response_class=Response,
        responses=_REPLIES)  # type: ignore[arg-type]
async def get_frames(link_id: str, service: ServiceDep, _: TokenDep, wait: Wait = 0.0,
                     ack: Ack = None) -> Response:
    """Long-poll for replies."""
    return _replies(*await service.link(link_id).answer(ack, wait))


@v1.delete("/links/{link_id}", status_code=204, tags=["frames"])
async def delete_link(link_id: str, service: ServiceDep, _: TokenDep) -> Response:
    service.close_link(link_id)
    return Response(status_code=204)


@v1.post("/sessions", status_code=201, tags=["sessions"])
async def create_session(params: SessionParams, service: ServiceDep, _: TokenDep) -> SessionCreated:
    """Open a session for a client that drafts on its own."""
    return service.create_session(params)


@v1.post("/sessions/{session_id}/prefill", tags=["sessions"])
async def prefill(session_id: str, body: PrefillBody, service: ServiceDep,
                  token: TokenDep) -> Prefilled:
    """Append tokens to the session's history (the prompt first) and run the target
    over them."""
    return Prefilled(total_tokens=await service.prefill(session_id, token, body.token_ids))


@v1.post("/sessions/{session_id}/verify", tags=["sessions"])
async def verify(session_id: str, body: VerifyBody, service: ServiceDep,
                 token: TokenDep) -> Verified:
    """Verify a draft continuing the session's history; the kept tokens and the target's
    own are appended to it."""
    return await service.verify(session_id, token, body)


@v1.delete("/sessions/{session_id}", status_code=204, tags=["sessions"])
async def delete_session(session_id: str, service: ServiceDep, token: TokenDep) -> Response:
    await service.delete_session(session_id, token)
    return Response(status_code=204)


ops = APIRouter(tags=["operations"])

# Every route and dependency is a coroutine: FastAPI runs plain functions on a thread
# pool, and the engine is used from its event loop only.


@ops.get("/healthz", response_class=PlainTextResponse)
async def healthz() -> str:
    """Alive."""
    return "ok\n"


@ops.get("/readyz", response_class=PlainTextResponse,
         responses={503: {"description": "full: no session can be opened now"}})
async def readyz(service: ServiceDep) -> PlainTextResponse:
    """200 while a session can be opened."""
    if service.engine.ready():
        return PlainTextResponse("ready\n")
    return PlainTextResponse("full\n", 503)


@ops.get("/status")
async def status(service: ServiceDep) -> dict[str, Any]:
    """Sessions, KV cache, evictions, errors by code, uptime and model."""
    return service.engine.status()


@ops.get("/metrics", response_class=PlainTextResponse)
async def metrics(service: ServiceDep) -> Response:
    """Prometheus metrics."""
    return Response(service.engine.metrics.exposition(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="SpecECD verifier", version=str(m.PROTOCOL_VERSION),
                  summary="Lossless speculative decoding: the cloud's verifier", redoc_url=None)
    app.state.service = Service(engine)
    app.include_router(v1)
    app.include_router(ops)
    app.add_middleware(BodyLimit, limit=engine.limits.max_message_bytes, engine=engine)

    async def typed(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HttpError):
            engine.metrics.errors.labels(exc.code).inc()
            return error_response(exc.status_code, exc.code, str(exc.detail))
        if isinstance(exc, ProtocolError):  # from the engine, which counted it
            return error_response(status_for(exc.code), exc.code, str(exc))
        if isinstance(exc, RequestValidationError):
            engine.metrics.errors.labels("malformed_frame").inc()
            return error_response(400, "malformed_frame", _validation_message(request, exc))
        assert isinstance(exc, HTTPException)  # routing: no such path or method
        return error_response(exc.status_code, ProtocolError.code, str(exc.detail))

    for kind in (HTTPException, ProtocolError, RequestValidationError):
        app.add_exception_handler(kind, typed)
    schema = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, less the 422 answers it documents by default: a request
        that fails validation is answered 400 ``malformed_frame`` here."""
        if app.openapi_schema is None:
            for operations in schema()["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                app.openapi_schema["components"]["schemas"].pop(name, None)  # type: ignore[index]
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _validation_message(request: Request, exc: RequestValidationError) -> str:
    if "json" not in request.headers.get("content-type", "") and any(
            tuple(error.get("loc", ())) == ("body",) for error in exc.errors()):
        return "bad request: send a JSON object, with the header Content-Type: application/json"
    parts = []
    for error in exc.errors()[:3]:
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "bad request: " + "; ".join(parts)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose protocol is named (``IPPROTO_TCP``, as getaddrinfo
    gives it), so that asyncio sets ``TCP_NODELAY`` on the connections it accepts. Without
    it (``socket.create_server`` leaves the protocol 0) a response's headers and body,
    written apart, wait about 40 ms for the client's delayed ACK."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the caller's event loop owns the signals: cancel serve() to stop


async def serve(engine: Engine, host: str, port: int,
                ssl_context: ssl.SSLContext | None = None,
                ready: Callable[[int], None] | None = None) -> None:
    """Serve until cancelled; ``ready`` gets the bound port (so port 0 works). A port
    that cannot be bound raises ``OSError``."""
    app = create_app(engine)
    config = uvicorn.Config(
        app, lifespan="off", ws="none", log_config=None, access_log=False, server_header=False,
        date_header=False, timeout_keep_alive=KEEP_ALIVE, timeout_graceful_shutdown=2,
        ssl_context_factory=(lambda _config, _default: ssl_context) if ssl_context else None)
    server = _Server(config)
    sock = listen(host, port)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        if task.done():
            task.result()
        if ready is not None:
            ready(sock.getsockname()[1])
        await asyncio.shield(task)
    finally:
        app.state.service.close()  # ends every link: long polls answer at once
        server.should_exit = True
        await task
        sock.close()


# -- client ---------------------------------------------------------------------------


@dataclass
class _Request:
    method: str
    target: str
    body: bytes | None
    timeout: float
    frame: bool = False  # a frame POST: a 200 means the server has the frame
    fresh: bool = True  # written on a connection that had answered nothing before


class _Metered:
    """A connected socket that counts the bytes ``http.client`` writes and reads."""

    def __init__(self, sock: socket.socket, owner: HttpTransport) -> None:
        self._sock, self._owner = sock, owner

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        self._owner.bytes_sent += len(data)

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_MeteredReader(self._sock.makefile("rb", buffering=0),
                                                self._owner))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _MeteredReader(io.RawIOBase):
    def __init__(self, raw: Any, owner: HttpTransport) -> None:
        self._raw, self._owner = raw, owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        n: int | None = self._raw.readinto(buffer)
        self._owner.bytes_received += n or 0
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def frame_type(frame: bytes) -> int:
    """A frame's message type, read without decoding it: every frame is a msgpack array
    of under 16 items (a one-byte header) whose first item, the type, is a small int."""
    return frame[1] if len(frame) > 1 and 0x90 <= frame[0] <= 0x9F else -1


def unpack_replies(body: bytes) -> list[bytes]:
    """The frames of a response body: each a 4-byte big-endian length, then the frame."""
    replies, i = [], 0
    while i < len(body):
        n = int.from_bytes(body[i:i + 4], "big")
        if i + 4 + n > len(body):
            raise ValueError("a truncated reply")
        replies.append(body[i + 4:i + 4 + n])
        i += 4 + n
    return replies


CLOSE_TIMEOUT = 2.0  # seconds close() spends telling the server, at most
_DELIVERED = (AuthFailed.code, ServerBusy.code, LimitExceeded.code)


class HttpTransport:
    """A blocking client link to a verifier over HTTP/1.1, for ``http://`` and ``https://``
    URLs (a path in the URL is kept as a prefix, for a server behind a proxy).

    One keep-alive connection carries everything. A frame that expects an answer (hello,
    draft, generate) is POSTed with a wait, so its reply comes back in the same exchange.
    A hint or a close is written and its response read later, by the next call or by
    :meth:`poll` once it has arrived, so sending one never waits for the network. No
    second connection is needed: the edge loop blocks in :meth:`recv` only when it has
    nothing to send, so a long-poll is never outstanding while it wants to send.

    Frames are numbered and replies acknowledged, so when a kept-alive connection turns
    out to be closed by the server the request is written once more on a new one. Every
    other failure (refused, reset, timed out, the link unknown or ended) raises
    ``ConnectionError``: the edge opens a new link and re-sends its history. The server's
    own refusals the WebSocket server would answer with an error frame (auth, busy, a
    frame over the size limit) arrive as that error frame.

    ``bytes_sent`` and ``bytes_received`` count the HTTP bytes written to and read from
    the connection: request and status lines, headers and bodies (under TLS, the bytes
    inside it; TCP/IP and TLS overhead are not counted).
    """

    def __init__(self, url: str, *, auth_token: str = "", cafile: str | None = None,
                 verify: bool = True, open_timeout: float = 10.0,
                 recv_timeout: float = 120.0) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise ValueError(f"bad server URL {url!r}: use http://host:port or "
                             f"https://host:port")
        self.url = url
        self.open_timeout, self.recv_timeout = open_timeout, recv_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        self._host = parts.hostname
        self._port = port or (443 if parts.scheme == "https" else 80)
        self._context = client_ssl_context(cafile, verify) if parts.scheme == "https" else None
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._conn: http.client.HTTPConnection | None = None
        self._answered = 0  # responses read on this connection
        self._inflight: _Request | None = None  # written, its response not read yet
        self._replies: deque[bytes] = deque()
        self._frames = 0  # frames the server has: the next one's number
        self._acked = 0  # replies received: the next one's number
        links = parts.path.rstrip("/") + "/v1/links"
        self._link: str | None = None  # the link's path; None once it has ended
        request = _Request("POST", links, b"", open_timeout)
        status, _, body = self._exchange(request)
        if status == 201:
            try:
                self._link = f"{links}/{json.loads(body)['link_id']}"
            except (ValueError, KeyError, TypeError) as exc:
                raise ConnectionError(f"{url} is not a SpecECD server ({exc})") from None
        else:
            self._refused(status, body)

    # -- the Transport protocol ---------------------------------------------------------
    def send(self, frame: bytes) -> None:
        self._settle()
        if self._link is None:
            if self._replies:
                return  # a refusal waits to be read; like a closing WebSocket, drop this
            raise ConnectionError(f"the link to {self.url} has ended")
        quiet = frame_type(frame) in (m.Hint.TYPE, m.Close.TYPE)  # nothing to wait for
        wait = 0.0 if quiet else min(self.recv_timeout, MAX_WAIT)
        request = _Request("POST", f"{self._link}/frames?n={self._frames}&ack={self._acked}"
                                   f"&wait={wait:g}", frame, wait + self.open_timeout, True)
        self._write(request)
        if quiet:
            self._inflight = request
        else:
            self._take(request, *self._finish(request))

    def recv(self) -> bytes:
        deadline = time.monotonic() + self.recv_timeout
        while not self._replies:
            if self._inflight is not None:
                self._settle()
                continue
            if self._link is None:
                raise ConnectionError(f"the link to {self.url} has ended")
            wait = min(deadline - time.monotonic(), MAX_WAIT)
            if wait <= 0:
                raise ConnectionError(f"{self.url} sent nothing in {self.recv_timeout:g} s")
            request = _Request("GET", f"{self._link}/frames?ack={self._acked}&wait={wait:.3f}",
                               None, wait + self.open_timeout)
            self._take(request, *self._exchange(request))
        return self._replies.popleft()

    def poll(self) -> bytes | None:
        """A reply that has already arrived, or None; never waits for one."""
        if not self._replies and self._inflight is not None and self._arrived():
            self._settle()
        if self._replies:
            return self._replies.popleft()
        if self._link is None and self._inflight is None:
            raise ConnectionError(f"the link to {self.url} has ended")
        return None

    def close(self) -> None:
        """End the link on the server (briefly: the server ends it anyway when idle)."""
        link, self._link = self._link, None
        with contextlib.suppress(Exception):  # closing a broken link must not raise
            if link is not None:
                if self._inflight is not None:
                    self._inflight.timeout = CLOSE_TIMEOUT
                    self._settle()
                self._exchange(_Request("DELETE", link, None, CLOSE_TIMEOUT))
        self._disconnect()

    # -- requests -----------------------------------------------------------------------
    def _exchange(self, request: _Request) -> tuple[int, Message, bytes]:
        self._write(request)
        return self._finish(request)

    def _write(self, request: _Request) -> None:
        while True:
            conn = self._connection()
            request.fresh = self._answered == 0
            try:
                conn.sock.settimeout(request.timeout)
                conn.request(request.method, request.target, request.body, self._headers)
                return
            except (OSError, http.client.HTTPException) as exc:
                self._disconnect()
                if request.fresh:
                    raise ConnectionError(f"connection to {self.url} lost: {exc}") from exc

    def _finish(self, request: _Request) -> tuple[int, Message, bytes]:
        """Read the response to ``request``; when the server had closed the kept-alive
        connection it went on, write it once more on a new one (it is idempotent)."""
        while True:
            assert self._conn is not None
            try:
                self._conn.sock.settimeout(request.timeout)
                response = self._conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self._disconnect()
                if request.fresh or isinstance(exc, TimeoutError):
                    raise ConnectionError(f"connection to {self.url} lost: {exc}") from exc
                self._write(request)
                continue
            self._answered += 1
            return response.status, response.msg, body

    def _settle(self) -> None:
        """Read the response to a hint or close still in flight."""
        request, self._inflight = self._inflight, None
        if request is not None:
            self._take(request, *self._finish(request))

    def _take(self, request: _Request, status: int, headers: Message, body: bytes) -> None:
        if status != 200:
            self._refused(status, body)
            return
        try:
            first = int(headers.get(FIRST_REPLY, ""))
            replies = unpack_replies(body)
        except ValueError as exc:
            raise ConnectionError(f"{self.url} sent a malformed response: {exc}") from None
        if first > self._acked:
            raise ConnectionError(f"{self.url} lost replies {self._acked} to {first - 1}")
        if request.frame:
            self._frames += 1
        self._replies.extend(replies[self._acked - first:])
        self._acked = max(self._acked, first + len(replies))

    def _refused(self, status: int, body: bytes) -> None:
        """An error answer: the error frame the session would have sent, for the refusals
        a WebSocket server answers with one; else ``ConnectionError``."""
        try:
            error = json.loads(body)["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "", body[:200].decode(errors="replace")
        if code not in _DELIVERED:
            raise ConnectionError(f"{self.url} answered {status} {code}: {message}")
        fatal = error_for_code(code, message).fatal
        self._replies.append(m.encode(m.Error(code, message, -1, fatal)))
        if fatal:
            self._link = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is not None and self._conn.sock is not None:
            return self._conn
        conn = (http.client.HTTPSConnection(self._host, self._port, timeout=self.open_timeout,
                                            context=self._context)
                if self._context is not None else
                http.client.HTTPConnection(self._host, self._port, timeout=self.open_timeout))
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            raise ConnectionError(f"cannot connect to {self.url}: {exc}") from exc
        conn.sock = _Metered(conn.sock, self)
        self._conn, self._answered = conn, 0
        return conn

    def _arrived(self) -> bool:
        sock = self._conn.sock if self._conn is not None else None
        if sock is None:
            return True  # let _settle find out
        pending = getattr(sock, "pending", None)  # bytes TLS has decrypted already
        return bool(pending and pending()) or bool(select.select([sock], [], [], 0)[0])

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None
