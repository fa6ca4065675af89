"""The OpenAI-compatible HTTP API on the edge: ``spececd api``.

:func:`create_app` puts a :class:`~spececd.generator.Generator` (draft model here, verifier
in this process or on a server) behind FastAPI:

- ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
  streaming as server-sent events (``stream_options.include_usage`` adds the usage
  chunk) and OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``);
- per response, ``usage`` with ``completion_tokens_details.accepted_prediction_tokens`` /
  ``rejected_prediction_tokens`` and a ``speculative`` object (:func:`speculative`); each
  streamed choice carries ``spececd``: where its tokens came from (``draft``: drafted and
  accepted, ``target``: the verifier's own, ``fallback``: the draft alone, unverified)
  and the statistics so far;
- ``GET /`` the playground (``playground.html``), ``GET /healthz``.

Each request runs its choices as sessions of their own on a worker thread each
(:attr:`Api.executor`), so concurrent requests overlap their round trips; the draft
model runs one forward pass at a time (:class:`~spececd.generator.Generator`).

Failures, each in OpenAI's error shape and each listed in the OpenAPI document
(``/openapi.json``): a bad request is a 400 naming the field (a missing or non-JSON body
says what to send), a wrong key 401, an unknown model or path 404, a request not sent
whole within the request timeout 408 (:mod:`spececd.transports.http.deadline`), a body
over ``max_request_bytes`` 413; a verifier that cannot be reached, is full or whose engine
failed is a 503 (unless the generator falls back to the draft model, which the response
then says), and one that refuses the edge a 502. Once a stream has begun, a failure
arrives as an ``error`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from spececd.core.stats import GenerationStats
from spececd.edge.link import CloudUnreachable
from spececd.edge.options import SAMPLING_SETTINGS, EdgeOptions
from spececd.errors import InputError, SpecECDError
from spececd.generator import AsyncGenerator, Generator, StreamChunk
from spececd.openai_api.limits import DEFAULT_MAX_REQUEST_BYTES
from spececd.openai_api.schema import (
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    Sampling,
    unsupported,
)
from spececd.protocol.errors import EngineFailed, ProtocolError, ServerBusy, Unsupported
from spececd.transports.http.common import BodyLimit

log = logging.getLogger(__name__)

DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming client is still there

# The error answers the OpenAPI document lists, by route kind.
_ERROR_STATUSES = {
    400: "a bad request: a field out of range, unknown or unsupported, a missing or non-JSON "
         "body, a prompt longer than the context (`param` names the field)",
    401: "a missing or wrong API key (`invalid_api_key`)",
    404: "an unknown model (`model_not_found`)",
    408: "the request was not sent whole within the server's request timeout "
         "(`request_timeout`)",
    413: "a body over the server's limit (`request_too_large`)",
    502: "the verifier refused this edge",
    503: "the verifier is unreachable (`cloud_unreachable`), full (`server_busy`) or its "
         "engine failed (`engine_failed`)",
}
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in _ERROR_STATUSES.items()}
LISTING_ERRORS: dict[int | str, dict[str, Any]] = {
    status: GENERATION_ERRORS[status] for status in (401, 408)}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


def api_error(exc: BaseException) -> ApiError:
    """What a failure of generation means to an API client."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InputError):
        return ApiError(400, str(exc))
    if isinstance(exc, CloudUnreachable):
        return ApiError(503, f"the verifier is unreachable: {exc}", "server_error",
                        code="cloud_unreachable")
    if isinstance(exc, EngineFailed):
        return ApiError(503, f"the verifier's engine failed: {exc}", "server_error",
                        code=exc.code)
    if isinstance(exc, ServerBusy):
        return ApiError(503, f"the verifier is full: {exc}", "server_error", code=exc.code)
    if isinstance(exc, Unsupported):  # a sampling setting the verifier's engine lacks
        return ApiError(400, f"the verifier cannot serve this request: {exc}", code=exc.code)
    if isinstance(exc, ProtocolError):
        return ApiError(502, f"the verifier refused this edge: {exc}", "server_error",
                        code=exc.code)
    log.exception("generation failed", exc_info=exc)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")


def speculative(stats: GenerationStats, cloud_only: bool) -> dict[str, Any]:
    """How speculation went: vLLM's speculative-decoding names (``num_drafts``,
    ``num_draft_tokens``, ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``) and
    SpecECD's own statistics."""
    d = stats.as_dict()
    return {
        "num_drafts": stats.rounds, "num_draft_tokens": stats.drafted,
        "num_accepted_tokens": stats.accepted,
        "num_accepted_tokens_per_pos": d["accepted_by_position"],
        "acceptance_rate": d["acceptance_rate"],
        "mean_acceptance_length": d["mean_accepted_len"],
        "acceptance_by_position": d["acceptance_by_position"],
        "rounds": stats.rounds, "network_s": d["network_s"], "verify_s": d["verify_s"],
        "draft_s": d["draft_s"], "tokens_per_s": d["tokens_per_s"],
        "fallback": stats.fallback, "fallback_tokens": stats.fallback_tokens,
        "lossy": stats.lossy, "cloud_only": cloud_only,
    }


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    seed: int
    stats: GenerationStats = field(default_factory=GenerationStats)
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    from_draft: int = 0  # of them, drafted and accepted
    finish_reason: str | None = None


@dataclass
class Run:
    """One request's choices, generated concurrently."""

    request: Sampling
    choices: list[Choice]
    prompt_tokens: int
    sampling: dict[str, Any]  # by SamplingParams' names, the seed aside (each choice's own)
    stop: list[str]
    options: EdgeOptions
    cloud_only: bool
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)

    def usage(self) -> dict[str, Any]:
        completion = sum(c.tokens for c in self.choices)
        # OpenAI's meaning: drafted tokens that appear in the completion, and the rest.
        accepted = sum(c.from_draft for c in self.choices)
        drafted = sum(c.stats.drafted for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted,
                                              "reasoning_tokens": 0}}

    def speculative(self) -> dict[str, Any]:
        total = GenerationStats()
        for choice in self.choices:
            total.merge(choice.stats)
        return speculative(total, self.cloud_only)

    def live(self, choice: Choice, chunk: StreamChunk) -> dict[str, Any]:
        """The ``spececd`` object of a streamed choice: this chunk's source and ids, and
        the choice's statistics so far."""
        stats = choice.stats
        return {"source": chunk.source, "token_ids": list(chunk.token_ids),
                "generated": choice.tokens, "drafted": stats.drafted,
                "accepted": stats.accepted, "rounds": stats.rounds,
                "acceptance_rate": round(stats.acceptance_rate, 4),
                "mean_acceptance_length": round(stats.mean_accepted_len, 4),
                "elapsed_s": round(time.perf_counter() - self.started, 4)}


class Api:
    """The routes' state: the generator, the served model's name and the API key."""

    def __init__(self, gen: Generator, model: str, api_key: str = "",
                 cloud_only: bool = False, max_concurrency: int = 64,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.gen, self.model, self.api_key = gen, model, api_key
        self.cloud_only = cloud_only
        self.max_request_bytes = max_request_bytes
        self.executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="spececd-api")
        self.agen = AsyncGenerator(gen, self.executor)

    def check(self, request: Request, body: Sampling) -> None:
        guard(self, request)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")
        if body.model != self.model:
            raise ApiError(404, f"The model `{body.model}` does not exist: this server "
                           f"serves `{self.model}` (see GET /v1/models)", param="model",
                           code="model_not_found")
        refused = unsupported(body)
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")

    def start(self, body: Sampling, prompts: list[list[int]], max_tokens: int | None,
              kind: str) -> Run:
        options = self.gen.options.with_settings(k=body.k, mode=body.mode,
                                                 proactive=body.proactive)
        context = self.gen.max_context
        if max_tokens is not None and max_tokens > context:  # never possible: say so
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) \
                else "max_tokens"
            raise ApiError(400, f"{param} is {max_tokens}, past the model's context of "
                           f"{context} tokens: ask for at most {context} (a completion also "
                           f"ends where it and the prompt fill the context)", param=param)
        longest = max(len(ids) for ids in prompts)
        room = context - longest
        # The body's sampling fields by their SamplingParams names, and what OpenAI's
        # meaning of some makes of them here.
        sampling: dict[str, Any] = {name: getattr(body, name) for name in SAMPLING_SETTINGS
                                    if name in Sampling.model_fields and name != "seed"}
        sampling.update(
            max_tokens=min(max_tokens, room) if max_tokens else room,
            top_k=max(body.top_k, 0), stop_token_ids=[
                *(() if body.ignore_eos else self.gen.tokenizer.eos_token_ids),
                *(body.stop_token_ids or ())])
        # Checked before streaming; the first choice's seed (drawn when none was given).
        base = self.gen.params(seed=body.seed, **sampling).seed
        assert base is not None
        choices = [Choice(p * body.n + i, ids, (base + p * body.n + i) % 2**63)
                   for p, ids in enumerate(prompts) for i in range(body.n)]
        cloud_only = self.cloud_only if body.cloud_only is None else body.cloud_only
        return Run(body, choices, sum(len(ids) for ids in prompts), sampling, body.stops(),
                   options, cloud_only, f"{kind}-{secrets.token_hex(12)}")

    async def chunks(self, run: Run) -> AsyncIterator[tuple[Choice, StreamChunk]]:
        """Every choice's chunks as they come, the choices generated concurrently."""
        queue: asyncio.Queue[tuple[Choice, StreamChunk | BaseException | None]] = \
            asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for chunk in self.agen.stream(
                        choice.prompt_ids, choice.stats, seed=choice.seed,
                        cloud_only=run.cloud_only, stop=run.stop, options=run.options,
                        **run.sampling):
                    await queue.put((choice, chunk))
            except Exception as exc:
                await queue.put((choice, exc))
            await queue.put((choice, None))

        tasks = [asyncio.ensure_future(pump(choice)) for choice in run.choices]
        try:
            remaining = len(tasks)
            while remaining:
                choice, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    choice.text.append(item.text)
                    choice.tokens += len(item.token_ids)
                    choice.from_draft += len(item.token_ids) if item.source == "draft" else 0
                    choice.finish_reason = item.finish_reason or choice.finish_reason
                    yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def respond(self, run: Run, chat: bool, request: Request) -> Response:
        stream = self.chunks(run)
        if not run.request.stream:
            async def drain() -> None:
                async for _ in stream:
                    pass

            work = asyncio.ensure_future(drain())
            while not (await asyncio.wait({work}, timeout=DISCONNECT_POLL))[0]:
                if await request.is_disconnected():  # nobody to answer: stop generating
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    return Response(status_code=499)
            work.result()  # a failure is answered by the app's handler (api_error)
            return JSONResponse(self.whole(run, chat))
        # The first chunk before the status line: a verifier that cannot be reached is a
        # 503, not a stream that fails.
        first = await anext(stream)
        return StreamingResponse(self.events(run, chat, first, stream),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def whole(self, run: Run, chat: bool) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for c in run.choices:
            text = "".join(c.text)
            body: dict[str, Any] = ({"message": {"role": "assistant", "content": text}}
                                    if chat else {"text": text})
            choices.append({"index": c.index, **body, "logprobs": None,
                            "finish_reason": c.finish_reason})
        return {"id": run.id, "object": "chat.completion" if chat else "text_completion",
                "created": run.created, "model": self.model, "choices": choices,
                "usage": run.usage(), "speculative": run.speculative()}

    async def events(self, run: Run, chat: bool, first: tuple[Choice, StreamChunk],
                     rest: AsyncIterator[tuple[Choice, StreamChunk]]) -> AsyncIterator[str]:
        usage = run.request.stream_options is not None and \
            run.request.stream_options.include_usage
        head: dict[str, Any] = {"id": run.id, "object": "chat.completion.chunk" if chat
                                else "text_completion", "created": run.created,
                                "model": self.model}
        if usage:
            head["usage"] = None
        started: set[int] = set()

        def event(choice: Choice, chunk: StreamChunk) -> str:
            body: dict[str, Any]
            if chat:
                delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
                if choice.index not in started:
                    delta = {"role": "assistant", "content": chunk.text}
                started.add(choice.index)
                body = {"delta": delta}
            else:
                body = {"text": chunk.text}
            return sse({**head, "choices": [{
                "index": choice.index, **body, "logprobs": None,
                "finish_reason": chunk.finish_reason, "spececd": run.live(choice, chunk)}]})

        try:
            yield event(*first)
            async for choice, chunk in rest:
                yield event(choice, chunk)
            if usage:
                yield sse({**head, "choices": [], "usage": run.usage(),
                           "speculative": run.speculative()})
        except Exception as exc:
            yield sse(api_error(exc).body())
        yield "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(api: Api) -> FastAPI:
    app = FastAPI(title="SpecECD OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.api = api

    async def answer(_: Request, exc: Exception) -> JSONResponse:
        error = api_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    # Ours (a bad value, an unreachable or refusing verifier) and anything unforeseen
    # answer in OpenAI's shape.
    for kind in (ApiError, SpecECDError, Exception):
        app.add_exception_handler(kind, answer)

    @app.exception_handler(HTTPException)
    async def on_http(_: Request, exc: HTTPException) -> JSONResponse:  # routing: 404, 405
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(
        BodyLimit, limit=api.max_request_bytes,
        refuse=lambda message: JSONResponse(too_large(message).body(), 413),
        error=too_large)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return on_validation(exc)

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        page = resources.files("spececd.openai_api").joinpath("playground.html")
        return HTMLResponse(page.read_text(encoding="utf-8"))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", responses=LISTING_ERRORS)
    async def models(request: Request) -> dict[str, Any]:
        guard(api, request)
        return {"object": "list", "data": [{"id": api.model, "object": "model",
                                            "created": 0, "owned_by": "spececd"}]}

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        api.check(request, body)
        prompts = await asyncio.to_thread(completion_prompts, api.gen, body)
        return await api.respond(api.start(body, prompts, body.max_tokens, "cmpl"), False,
                                 request)

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat(body: ChatRequest, request: Request) -> Response:
        api.check(request, body)
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in body.messages]
        ids = await asyncio.to_thread(api.gen.chat_ids, messages)
        limit = body.max_completion_tokens or body.max_tokens
        return await api.respond(api.start(body, [ids], limit, "chatcmpl"), True, request)

    schema = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, less the 422 it lists by default: a request that fails
        validation is answered 400 here, in OpenAI's shape."""
        if app.openapi_schema is None:
            for operations in schema()["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                app.openapi_schema["components"]["schemas"].pop(name, None)  # type: ignore[index]
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def too_large(message: str) -> ApiError:
    return ApiError(413, f"{message}: send a shorter request", code="request_too_large")


def guard(api: Api, request: Request) -> None:
    """The API key check alone, for routes without a body."""
    if api.api_key:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 api.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided: send the server's key as "
                           "`Authorization: Bearer <key>`", code="invalid_api_key")


def completion_prompts(gen: Generator, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    many: list[Any] = [prompt] if isinstance(prompt, str) or (
        prompt and isinstance(prompt[0], int)) else list(prompt)
    if not many:
        raise ApiError(400, "prompt is empty: give a string, a list of strings, or token ids",
                       param="prompt")
    return [gen.prompt_ids(p) for p in many]


def on_validation(exc: RequestValidationError) -> JSONResponse:
    """Pydantic's first complaint, in OpenAI's shape, naming the field."""
    error = exc.errors()[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None  # the request's field; the rest is pydantic's path
    if param is None and error.get("type") != "json_invalid":  # no body, or not an object
        message = ("the request needs a JSON object as its body, sent with the header "
                   "`Content-Type: application/json`, e.g. {\"model\": \"...\", "
                   "\"prompt\": \"...\"} (chat: \"messages\" instead of \"prompt\")")
    elif error.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif error.get("type") == "json_invalid":
        message = "We could not parse the JSON body of your request: send valid JSON"
    elif error.get("type") == "missing":
        message = f"you must provide the `{param}` parameter"
    else:
        where = ".".join(loc)
        message = f"{where}: {error.get('msg')}" if where else str(error.get("msg"))
    return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

