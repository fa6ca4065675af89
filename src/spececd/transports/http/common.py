"""What every HTTP route shares: typed errors, the body limit, bearer auth.

Every error is ``{"error": {"code": ..., "message": ...}}`` with a code from
:mod:`spececd.protocol.errors` and a status for its kind: 400 malformed or invalid, 401
auth, 404 unknown session or link, 409 out of order, 413 over a limit, 500 verification
failed, 503 busy, draining or failed (``engine_failed``). A body that is not what an
endpoint takes (bad JSON, a wrong type, a missing field) is ``malformed_frame``, the
protocol's code for an undecodable message.
Errors found here are counted in the engine's ``spececd_errors_total``; those the engine
answered itself were counted by it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from spececd.cloud.service import CloudService
from spececd.protocol.errors import (
    AuthFailed,
    Draining,
    EngineFailed,
    LimitExceeded,
    MalformedFrame,
    OutOfOrder,
    ProtocolError,
    ServerBusy,
    UnknownSession,
    VerificationFailed,
)

_STATUS = {AuthFailed.code: 401, UnknownSession.code: 404, OutOfOrder.code: 409,
           LimitExceeded.code: 413, VerificationFailed.code: 500, ServerBusy.code: 503,
           Draining.code: 503, EngineFailed.code: 503}


def status_for(code: str) -> int:
    """The HTTP status for a protocol error code (400 unless it names another kind)."""
    return _STATUS.get(code, 400)


class HttpError(HTTPException):
    """A protocol error found by the HTTP layer (not one the engine answered)."""

    def __init__(self, error: ProtocolError) -> None:
        super().__init__(status_for(error.code), str(error))
        self.code = error.code


class ErrorDetail(BaseModel):
    code: str = Field(description="a code from SpecECD's error tree, e.g. invalid_tokens")
    message: str = Field(description="what was wrong and what to do")


class ErrorBody(BaseModel):
    error: ErrorDetail


# The error answers of every /v1 endpoint, for the OpenAPI schema.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description} for status, description in (
        (400, "malformed or invalid: malformed_frame, invalid_tokens, invalid_probabilities,"
              " unexpected_message"),
        (401, "auth_failed"), (404, "unknown_session"), (409, "out_of_order"),
        (413, "limit_exceeded"), (500, "verification_failed"),
        (503, "server_busy, draining, engine_failed"))}


def error_response(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else \
        {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers)


def answer_errors(app: FastAPI, engine: CloudService) -> None:
    """Answer every error ``app`` raises in the typed shape."""

    async def typed(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HttpError):
            engine.metrics.errors.labels(exc.code).inc()
            return error_response(exc.status_code, exc.code, str(exc.detail))
        if isinstance(exc, ProtocolError):  # from the engine, which counted it
            return error_response(status_for(exc.code), exc.code, str(exc))
        if isinstance(exc, RequestValidationError):
            engine.metrics.errors.labels(MalformedFrame.code).inc()
            return error_response(400, MalformedFrame.code, _explain(request, exc))
        assert isinstance(exc, HTTPException)  # routing: no such path or method
        return error_response(exc.status_code, ProtocolError.code, str(exc.detail))

    for kind in (HTTPException, ProtocolError, RequestValidationError):
        app.add_exception_handler(kind, typed)


def without_422(app: FastAPI) -> None:
    """Serve ``app``'s OpenAPI document less the 422 FastAPI lists by default: a request
    that fails validation is answered 400 here (in the transport's shape, or OpenAI's)."""
    schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for operations in schema()["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                app.openapi_schema["components"]["schemas"].pop(name, None)  # type: ignore[index]
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _explain(request: Request, exc: RequestValidationError) -> str:
    if "json" not in request.headers.get("content-type", "") and any(
            tuple(error.get("loc", ())) == ("body",) for error in exc.errors()):
        return "bad request: send a JSON object, with the header Content-Type: application/json"
    parts = [f"{'.'.join(str(p) for p in error.get('loc', ()))}: {error.get('msg', 'invalid')}"
             for error in exc.errors()[:3]]
    return "bad request: " + "; ".join(parts)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused, unread when it
    declares its length (``refuse(message)``: the response), else as soon as it has grown
    past the limit (``error(message)``: raised in the route's body read, for the app's
    handler to answer). Without ``refuse``/``error``: a 413 with a typed
    ``limit_exceeded`` error, counted in ``engine``'s metrics."""

    def __init__(self, app: ASGIApp, limit: int, engine: CloudService | None = None,
                 refuse: Callable[[str], Response] | None = None,
                 error: Callable[[str], Exception] | None = None) -> None:
        self.app, self.limit = app, limit

        def refused(message: str) -> Response:
            if engine is not None:
                engine.metrics.errors.labels(LimitExceeded.code).inc()
            return error_response(413, LimitExceeded.code, message)

        self.refuse = refuse or refused
        self.error = error or (lambda message: HttpError(LimitExceeded(message)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            await self.refuse(self._message(declared))(scope, receive, send)
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # raised in the route's body read: answered typed
                raise self.error(self._message(b"more"))
            return message

        await self.app(scope, limited, send)

    def _message(self, declared: bytes) -> str:
        return (f"a body of {declared.decode(errors='replace')[:20]} bytes is over the "
                f"limit of {self.limit}")


async def _engine(request: Request) -> CloudService:
    engine: CloudService = request.app.state.engine
    return engine


_bearer = HTTPBearer(auto_error=False, description="the server's auth token, when it has one")


async def _token(engine: Annotated[CloudService, Depends(_engine)],
                 credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
                 ) -> str:
    """The bearer token, checked against the engine's (none needed when it has none)."""
    token = credentials.credentials if credentials is not None else ""
    expected = engine.auth_token
    if expected and not hmac.compare_digest(token.encode(), expected.encode()):
        raise HttpError(AuthFailed("missing or wrong auth token: send the header "
                                   "`Authorization: Bearer <token>`"))
    return token


# Every route and dependency is a coroutine: FastAPI runs plain functions on a thread
# pool, and the engine is used from its event loop only.
EngineDep = Annotated[CloudService, Depends(_engine)]
TokenDep = Annotated[str, Depends(_token)]  # an authorized request's token
