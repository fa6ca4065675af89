"""The OpenAI-compatible HTTP API on the edge: ``spececd api``.

:func:`create_app` puts a :class:`~spececd.generator.Generator` (draft model here, verifier
in this process or on a server) behind FastAPI:

- ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
  streaming as server-sent events (``stream_options.include_usage`` adds the usage
  chunk) and OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``);
- OpenAI's Predicted Outputs (``prediction``, on both routes, with any other field): the
  text the output is expected to be, in the target's tokens, drafted first where the
  output follows it (:class:`~spececd.edge.sources.PredictedDraft`); the output stays the
  target's own;
- per response, ``usage`` with ``completion_tokens_details.accepted_prediction_tokens`` /
  ``rejected_prediction_tokens`` (:meth:`Run.usage`) and a ``speculative`` object
  (:func:`speculative`); each streamed choice carries ``spececd``: where its tokens came
  from (``draft``: drafted and accepted, ``prediction``: drafted from the prediction and
  accepted, ``target``: the verifier's own, ``fallback``: the draft alone, unverified)
  and the statistics so far;
- ``GET /`` the playground (the page built from ``web/``, in its API mode), ``GET /healthz``;
- tool calls (:mod:`spececd.openai_api.tools`): ``tools`` rendered by the chat template,
  calls parsed out of the output in the format of ``tool_parser`` (by default the one the
  chat template writes calls in) into
  ``message.tool_calls`` (``finish_reason: "tool_calls"``), or streamed as OpenAI's
  ``tool_calls`` deltas (a call's id and name, then its arguments) once each call is
  whole, the text before it as content; ``tool_choice`` ``required`` or a named function
  forced by a grammar the verifier masks with;
- log-probabilities, the target's own (:mod:`spececd.core.logprobs`): chat's ``logprobs``
  and ``top_logprobs`` (``choices[].logprobs.content``), completions' ``logprobs: N`` in
  OpenAI's legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``: the ``N`` most
  likely and the chosen token, ``text_offset``) and ``echo`` (the prompt before the
  completion, with its log-probabilities, the first ``null``; ``max_tokens: 0`` generates
  nothing: scoring, as lm-evaluation-harness asks). ``-inf`` (a token a filter removed,
  in ``processed_logprobs`` mode) is written ``-9999.0``, as vLLM writes it.

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
import dataclasses
import functools
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles

from spececd.core.logprobs import TokenLogprob
from spececd.core.params import Constraint
from spececd.core.stats import GenerationStats
from spececd.edge.link import CloudUnreachable
from spececd.edge.lookup import Alignment
from spececd.edge.options import SAMPLING_SETTINGS, EdgeOptions
from spececd.errors import InputError, SpecECDError
from spececd.generator import AsyncGenerator, Generator, PromptTooLong, StreamChunk
from spececd.grammar import grammars_for, warm
from spececd.openai_api import schema
from spececd.openai_api.limits import DEFAULT_MAX_REQUEST_BYTES
from spececd.openai_api.schema import (
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    FieldError,
    Sampling,
    unsupported,
)
from spececd.openai_api.tool_parsers import ToolCall, ToolStream, parser
from spececd.openai_api.tools import ToolPlan, plan, template_messages, template_parser
from spececd.protocol.errors import (
    EngineFailed,
    InvalidConstraint,
    ProtocolError,
    ServerBusy,
    Unsupported,
)
from spececd.transports import web
from spececd.transports.http.common import BodyLimit, without_422

log = logging.getLogger(__name__)

DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming client is still there
NO_LOGPROB = -9999.0  # how -inf is written (JSON has no infinity), as vLLM writes it

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
    if isinstance(exc, FieldError):
        return ApiError(400, str(exc), param=exc.param)
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
    if isinstance(exc, InvalidConstraint):  # the verifier could not compile it
        return ApiError(400, f"the verifier refused the constraint: {exc}", code=exc.code)
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
        "rounds": stats.rounds, "target_passes": stats.target_passes,
        "network_s": d["network_s"], "verify_s": d["verify_s"],
        "draft_s": d["draft_s"], "tokens_per_s": d["tokens_per_s"],
        "forced_tokens": stats.forced_tokens,
        "lookup_drafted": stats.lookup_drafted, "lookup_accepted": stats.lookup_accepted,
        "fallback": stats.fallback, "fallback_tokens": stats.fallback_tokens,
        "lossy": stats.lossy, "cloud_only": cloud_only,
    }


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    seed: int
    # What generation starts from: the text of a completion's text prompt that is healed
    # (Generator.stream heals text), else the ids.
    prompt: str | list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    from_draft: int = 0  # of them, drafted and accepted
    finish_reason: str | None = None
    tools: ToolStream | None = None  # calls are parsed out of the text, as it streams
    calls: int = 0  # tool calls streamed so far
    max_calls: int | None = None  # calls kept (parallel_tool_calls false: the first)

    def keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        room = len(calls) if self.max_calls is None else self.max_calls - self.calls
        return calls[:max(room, 0)]

    prompt_text: str = ""  # what echo puts before the completion
    # Predicted Outputs: the prediction's ids as this choice drafts them (after the text
    # token healing took off its prompt, which its first token spells again); none: ()
    prediction: tuple[int, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # None: unverified
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    offset: int = 0  # streamed completions' text_offset so far


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
    logprobs: int | None = None  # alternatives per token, when asked
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    score_only: bool = False  # max_tokens 0: nothing generated (the prompt scored, if asked)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage. With a prediction, its ``accepted_prediction_tokens`` are the
        prediction's tokens that appeared in a completion (aligned as a diff would, each
        counted once: :class:`~spececd.edge.lookup.Alignment`) and
        ``rejected_prediction_tokens`` the prediction's other tokens, per choice, summed
        over the choices; without one, both are 0 (the ``speculative`` object counts the
        drafts). Unlike OpenAI's, ``completion_tokens`` counts the generated tokens only,
        not the rejected prediction tokens: a prediction costs the server no generation."""
        completion = sum(c.tokens for c in self.choices)
        accepted = rejected = 0
        for c in (c for c in self.choices if c.prediction):
            alignment = Alignment(c.prediction)
            alignment.sync(c.token_ids)
            accepted += alignment.hits
            rejected += len(c.prediction) - alignment.hits
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": rejected,
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
                 tool_parser: str | None = None, token_healing: bool = False,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.gen, self.model, self.api_key = gen, model, api_key
        self.cloud_only = cloud_only
        if tool_parser is not None:
            parser(tool_parser)  # a known name, or the error that lists them
        # The format calls are parsed in: the one given, else the one the model's chat
        # template writes calls in (None: neither, and requests with tools are refused).
        self.tool_parser = tool_parser or template_parser(gen.tokenizer)
        self.tool_parser_source = "given" if tool_parser else "the chat template's"
        # A completion's text prompts are healed when the request says so, or by this
        # default: off, as in every other OpenAI-compatible server (the reply continues the
        # prompt's own tokens).
        self.token_healing = token_healing
        self.max_request_bytes = max_request_bytes
        self.executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="spececd-api")
        # the first constrained request: no set-up (joined by close)
        self._grammar_warm = warm(gen.tokenizer, gen.vocab_size)
        self.agen = AsyncGenerator(gen, self.executor)
        self._token_texts: dict[int, str] = {}
        self._vocab: list[str] | None = None  # the tokenizer's token strings, when needed

    def close(self) -> None:
        """Cancel the requests still queued and wait for the grammars' warm-up to end."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._grammar_warm.join()

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

    def compile(self, body: Sampling) -> None:
        """Compile the request's constraint (off the event loop: it may take up to the
        compile time limit), so that an invalid one is a 400 before anything runs."""
        found = body.constraint_field()
        if found is not None:
            try:
                grammars_for(self.gen.tokenizer, self.gen.vocab_size).compile(found[1])
            except InputError as exc:
                raise FieldError(found[0], str(exc)) from None

    def _dropped(self, text: str | None, constraint: Constraint | None) -> str:
        """The text token healing takes off the prompt ``text`` (None: a prompt not healed),
        as the generator heals it: never under a constraint."""
        if text is None or constraint is not None:
            return ""
        _, healing = self.gen.healed(text, True)
        return healing.dropped if healing is not None else ""

    def start(self, body: Sampling, prompts: list[list[int]], max_tokens: int | None,
              kind: str, tools: ToolPlan | None = None,
              prompt_texts: Sequence[str] = (),
              heal_texts: list[str | None] | None = None) -> Run:
        """A request's run. ``max_tokens`` 0 (completions) generates nothing: the
        verifier's one step (cloud-only) scores the prompt, and its token is dropped.
        ``prompt_texts``: what echo puts before each prompt's completions; ``heal_texts``:
        each prompt's text where it is to be healed."""
        options = self.gen.options.with_settings(k=body.k, mode=body.mode,
                                                 proactive=body.proactive,
                                                 draft_source=body.draft_source)
        context = self.gen.max_context
        longest = max(len(ids) for ids in prompts)
        room = context - longest
        if max_tokens is not None and max_tokens > room:  # as OpenAI and vLLM: refused
            raise context_exceeded(context, longest, body, limit_param(body))
        # The body's sampling fields by their SamplingParams names, and what OpenAI's
        # meaning of some makes of them here.
        sampling: dict[str, Any] = {name: getattr(body, name) for name in SAMPLING_SETTINGS
                                    if name in Sampling.model_fields and name != "seed"}
        score_only = max_tokens == 0
        echo = isinstance(body, CompletionRequest) and body.echo
        logprobs = body.logprobs if isinstance(body, CompletionRequest) else (
            (body.top_logprobs or 0) if isinstance(body, ChatRequest) and body.logprobs
            else None)
        sampling.update(
            constraint=body.constraint(),
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
            max_tokens=1 if score_only else max_tokens or room,
            top_k=max(body.top_k, 0), stop_token_ids=[
                *(() if body.ignore_eos else self.gen.tokenizer.eos_token_ids),
                *(body.stop_token_ids or ())])
        if tools is not None and tools.grammar is not None:  # the calls, forced
            sampling["constraint"] = Constraint("grammar", tools.grammar)
        # Checked before streaming; the first choice's seed (drawn when none was given).
        base = self.gen.params(seed=body.seed, **sampling).seed
        assert base is not None
        parser = tools.parser if tools is not None else None
        texts = list(prompt_texts) or [""] * len(prompts)
        healed = heal_texts or [None] * len(prompts)
        text = body.prediction.text() if body.prediction else None
        try:  # in the target's tokens, as the output is; after what healing drops
            predictions = [self.gen.prediction_ids(text, self._dropped(
                healed[p], sampling["constraint"])) if text else ()
                for p in range(len(prompts))]
        except InputError as exc:
            raise FieldError("prediction", f"prediction: {exc}") from None
        choices = [Choice(p * body.n + i, ids, (base + p * body.n + i) % 2**63,
                          tools=parser.stream() if parser else None,
                          max_calls=tools.max_calls if tools is not None else None,
                          prompt_text=texts[p] if echo else "", prompt=healed[p] or ids,
                          prediction=predictions[p])
                   for p, ids in enumerate(prompts) for i in range(body.n)]
        cloud_only = score_only or (self.cloud_only if body.cloud_only is None
                                    else body.cloud_only)
        return Run(body, choices, sum(len(ids) for ids in prompts), sampling, body.stops(),
                   options, cloud_only, f"{kind}-{secrets.token_hex(12)}", logprobs, echo,
                   score_only)

    async def chunks(self, run: Run) -> AsyncIterator[tuple[Choice, StreamChunk]]:
        """Every choice's chunks as they come, the choices generated concurrently."""
        queue: asyncio.Queue[tuple[Choice, StreamChunk | BaseException | None]] = \
            asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for chunk in self.agen.stream(
                        choice.prompt, choice.stats, seed=choice.seed,
                        token_healing=isinstance(choice.prompt, str),
                        cloud_only=run.cloud_only, stop=run.stop, options=run.options,
                        prediction=choice.prediction, **run.sampling):
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
                    if item.prompt_logprobs is not None:
                        choice.prompt_logprobs = item.prompt_logprobs
                    if run.score_only:  # the scoring step's token is no part of the reply
                        item = dataclasses.replace(
                            item, token_ids=(), text="", logprobs=None,
                            finish_reason="length" if item.finish_reason else None)
                    choice.text.append(item.text)
                    choice.tokens += len(item.token_ids)
                    choice.token_ids.extend(item.token_ids)
                    choice.logprobs.extend(item.logprobs or (None,) * len(item.token_ids))
                    choice.from_draft += (len(item.token_ids)
                                          if item.source in ("draft", "forced", "lookup",
                                                             "prediction")
                                          else 0)
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
                                    if chat else {"text": c.prompt_text + text})
            finish = c.finish_reason
            if c.tools is not None:
                content, calls = c.tools.push(text)
                rest, more = c.tools.flush(cut_off=finish == "length")
                calls = c.keep(calls + more)
                body["message"]["content"] = (content + rest) or None
                if calls:
                    body["message"]["tool_calls"] = [call.as_openai() for call in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c.index, **body,
                            "logprobs": self.logprobs(run, c, c.token_ids, c.logprobs, chat,
                                                      first=True),
                            "finish_reason": finish})
        return {"id": run.id, "object": "chat.completion" if chat else "text_completion",
                "created": run.created, "model": self.model, "choices": choices,
                "usage": run.usage(), "speculative": run.speculative()}

    def token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.gen.tokenizer.decode([token])
        return text

    def logprobs(self, run: Run, choice: Choice, token_ids: Sequence[int],
                 entries: Sequence[TokenLogprob | None], chat: bool, first: bool
                 ) -> dict[str, Any] | None:
        """``choice``'s log-probabilities of ``token_ids`` in OpenAI's shape, chat's or
        completions' legacy one (with echo, on the ``first`` part of a choice, the prompt's
        before them; ``text_offset`` counts from the start of the choice's text); None when
        the request asked for none, or for a part without tokens (a stream's last event).
        An unverified token (the draft's alone) has null."""
        echoed = run.echo and first
        if run.logprobs is None or not (token_ids or echoed):
            return None
        if chat:
            return {"content": [self.chat_entry(token, entry)
                                for token, entry in zip(token_ids, entries, strict=True)],
                    "refusal": None}
        pairs = list(zip(token_ids, entries, strict=True))
        if echoed:
            prompt = choice.prompt_logprobs or (None,) * len(choice.prompt_ids)
            pairs = [*zip(choice.prompt_ids, prompt, strict=True), *pairs]
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token, entry in pairs:
            text = self.token_text(token)
            tokens.append(text)
            offsets.append(choice.offset)
            choice.offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(finite(entry.logprob))
            top = {self.token_text(t): finite(value) for t, value in entry.top}
            top.setdefault(text, finite(entry.logprob))  # OpenAI's: the chosen one too
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def token_bytes(self, token: int) -> list[int]:
        """A token's UTF-8 bytes, as OpenAI's ``bytes``: a token that holds part of a
        character (its text alone decodes to U+FFFD) gives its own bytes where the
        tokenizer's token string spells them (byte-level BPE, SentencePiece's
        ``<0xNN>``)."""
        text = self.token_text(token)
        if "\ufffd" not in text:
            return list(text.encode())
        if self._vocab is None:
            self._vocab = self.gen.tokenizer.vocab_tokens()
        piece = self._vocab[token] if token < len(self._vocab) else ""
        if found := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return [int(found[1], 16)]
        table = byte_level_decoder()
        if piece and all(c in table for c in piece):
            return [table[c] for c in piece]
        return list(text.encode())

    def chat_entry(self, token: int, entry: TokenLogprob | None) -> dict[str, Any]:
        return {"token": self.token_text(token),
                "logprob": finite(entry.logprob) if entry else None,
                "bytes": self.token_bytes(token),
                "top_logprobs": [{"token": self.token_text(t), "logprob": finite(value),
                                  "bytes": self.token_bytes(t)}
                                 for t, value in (entry.top if entry else ())]}

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
            finish = chunk.finish_reason
            first = choice.index not in started
            started.add(choice.index)
            if chat:
                text, calls = chunk.text, list[ToolCall]()
                if choice.tools is not None:  # content as it is certain, calls once whole
                    text, calls = choice.tools.push(text)
                    if finish is not None:
                        rest, more = choice.tools.flush(cut_off=finish == "length")
                        text, calls = text + rest, calls + more
                    calls = choice.keep(calls)
                deltas: list[dict[str, Any]] = [{"content": text} if text else {}]
                if first:
                    deltas[0] = {"role": "assistant", "content": text}
                for call in calls:  # OpenAI's: id and name, then the arguments
                    deltas += [{"tool_calls": [{"index": choice.calls, "id": call.id,
                                                "type": "function", "function": {
                                                    "name": call.name, "arguments": ""}}]},
                               {"tool_calls": [{"index": choice.calls, "function": {
                                   "arguments": call.arguments}}]}]
                    choice.calls += 1
                if finish == "stop" and choice.calls:
                    finish = "tool_calls"
                if len(deltas) > 1 and deltas[0] == {}:
                    deltas.pop(0)
            else:
                deltas = [{"text": (choice.prompt_text if first else "") + chunk.text}]
            live = run.live(choice, chunk)
            entries = chunk.logprobs or (None,) * len(chunk.token_ids)
            logprobs = self.logprobs(run, choice, chunk.token_ids, entries, chat, first)
            return "".join(sse({**head, "choices": [{
                "index": choice.index, **({"delta": delta} if chat else delta),
                "logprobs": logprobs if i == 0 else None,
                "finish_reason": finish if i == len(deltas) - 1 else None,
                "spececd": live}]}) for i, delta in enumerate(deltas))

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


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character to byte: printable bytes stand for
    themselves, the others for characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def finite(logprob: float) -> float:
    return logprob if logprob > NO_LOGPROB else NO_LOGPROB


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
        code = "request_too_large" if exc.status_code == 413 else None  # a chunked body's
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), code=code).body(),
                            status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(
        BodyLimit, limit=api.max_request_bytes,
        refuse=lambda message: JSONResponse(too_large(message).body(), 413),
        # Raised inside FastAPI's body read, which answers only an HTTPException as itself.
        error=lambda message: HTTPException(413, str(too_large(message))))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return on_validation(exc)

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
        await asyncio.to_thread(api.compile, body)
        prompts = await asyncio.to_thread(completion_prompts, api.gen, body)
        # Healing when asked (or by the server's default), never where the prompt's own
        # tokens are asked back (echo).
        if body.echo and body.token_healing:
            raise FieldError("token_healing", "echo returns the prompt's own tokens (and "
                             "their log-probabilities), which healing changes: leave "
                             "token_healing out with echo, or set it to false")
        heal = (api.token_healing and not body.echo if body.token_healing is None
                else body.token_healing)
        heal_texts = [p if heal and isinstance(p, str) else None for p in prompt_list(body)]
        texts = await asyncio.to_thread(echoed_prompts, api.gen, body, prompts)
        run = api.start(body, prompts, body.max_tokens, "cmpl", prompt_texts=texts,
                        heal_texts=heal_texts)
        return await api.respond(run, False, request)

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat(body: ChatRequest, request: Request) -> Response:
        api.check(request, body)
        await asyncio.to_thread(api.compile, body)
        tools = await asyncio.to_thread(plan, body, api.tool_parser)  # xgrammar builds
        ids = await asyncio.to_thread(chat_prompt, api.gen, body, tools)
        limit = body.max_completion_tokens or body.max_tokens
        return await api.respond(api.start(body, [ids], limit, "chatcmpl", tools), True,
                                 request)

    without_422(app)
    # Last: the playground's files answer any one-segment path no route above took.
    page = StaticFiles(directory=web.BUILT, html=True, check_dir=False)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def playground(request: Request, name: str = "") -> Response:
        """The playground (web/, built) and its files, as Starlette's StaticFiles serves
        them (read in a worker thread; ETag, HEAD and ranges), with the headers and the
        content types the page needs (:mod:`spececd.transports.web`'s)."""
        if not name and not (web.BUILT / "index.html").is_file():
            return PlainTextResponse(web.NOT_BUILT, 404)
        if name.startswith("."):
            raise HTTPException(404)
        response = await page.get_response(name or ".", request.scope)
        response.headers.update({**dict(web.HEADERS), web.SERVES: "api"})
        kind = web.content_type(name or "index.html")
        if response.status_code in (200, 206) and kind:
            response.headers["content-type"] = kind
        return response

    @app.api_route("/{name}", methods=["POST", "PUT", "PATCH", "DELETE"],
                   include_in_schema=False)
    async def nothing_here(name: str) -> Response:
        raise HTTPException(404)  # as routing answers a path it has no route for

    return app


def limit_param(body: Sampling) -> str:
    """The field that holds the request's limit on generated tokens."""
    return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) \
        else "max_tokens"


def context_exceeded(context: int, prompt: int, body: Sampling, param: str) -> ApiError:
    """OpenAI's context overflow, in its words (which frameworks look for, with its code
    ``context_length_exceeded``): ``prompt`` tokens and the request's ``max_tokens`` (or
    ``max_completion_tokens``) past the model's ``context``; ``param``: the field to
    change (the prompt, or the limit)."""
    if isinstance(body, ChatRequest):
        what, limit = "messages", body.max_completion_tokens or body.max_tokens
    else:
        assert isinstance(body, CompletionRequest)
        what, limit = "prompt", body.max_tokens
    head = f"This model's maximum context length is {context} tokens. However, "
    if limit is None:
        message = (f"{head}your {what} resulted in {prompt} tokens, which leaves no room "
                   f"for the completion. Please reduce the length of the {what}.")
    else:
        room = context - prompt
        message = (f"{head}you requested {prompt + limit} tokens ({prompt} in the {what}, "
                   f"{limit} for the completion). Please reduce the length of the {what}"
                   + (f", or {limit_param(body)} to at most {room}." if room > 0 else "."))
    return ApiError(400, message, param=param, code="context_length_exceeded")


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


def prompt_list(body: CompletionRequest) -> list[Any]:
    """A completion request's prompts: texts or lists of token ids."""
    prompt = body.prompt
    return [prompt] if isinstance(prompt, str) or (
        prompt and isinstance(prompt[0], int)) else list(prompt)


def completion_prompts(gen: Generator, body: CompletionRequest) -> list[list[int]]:
    many = prompt_list(body)
    if not many:
        raise ApiError(400, "prompt is empty: give a string, a list of strings, or token ids",
                       param="prompt")
    try:
        return [gen.prompt_ids(p) for p in many]
    except PromptTooLong as exc:
        raise context_exceeded(exc.context, exc.tokens, body, "prompt") from None
    except InputError as exc:  # empty, an id out of range
        raise FieldError("prompt", str(exc)) from None


def chat_prompt(gen: Generator, body: ChatRequest, tools: ToolPlan) -> list[int]:
    """The conversation's prompt ids; the template's or the context's refusal names the
    field at fault."""
    try:
        return gen.chat_ids(template_messages(body.messages), tools.tools)
    except PromptTooLong as exc:
        raise context_exceeded(exc.context, exc.tokens, body, "messages") from None
    except FieldError:
        raise
    except InputError as exc:  # a template that takes no tools, or refuses the messages
        param = "tools" if tools.tools and "tools" in str(exc) else "messages"
        raise FieldError(param, str(exc)) from None


def echoed_prompts(gen: Generator, body: CompletionRequest, prompts: list[list[int]]
                   ) -> list[str]:
    """What ``echo`` puts before each prompt's completions: the prompt as written, or
    the text of its token ids."""
    if not body.echo:
        return []
    prompt = body.prompt
    written = [prompt] if isinstance(prompt, str) else prompt if prompt and all(
        isinstance(p, str) for p in prompt) else None
    if written is not None:
        return [str(p) for p in written]
    return [gen.tokenizer.decode(ids) for ids in prompts]


def on_validation(exc: RequestValidationError) -> JSONResponse:
    """Pydantic's complaint in OpenAI's shape and words: ``param`` the field's path in the
    request (``messages[0].content``), without pydantic's names for the members of a union
    or its ``[key]``, and where the value fits none of a union's members, what each takes."""
    errors = exc.errors()
    raised = (errors[0].get("ctx") or {}).get("error")
    if isinstance(raised, FieldError):  # a check across fields names its own
        return JSONResponse(ApiError(400, str(raised), param=raised.param).body(),
                            status_code=400)
    paths = [field_path(error, exc.body) for error in errors]
    deepest = max(paths, key=len)
    # The errors at that path: one, or each member's of a union none of which fits.
    found = [error for error, path in zip(errors, paths, strict=True) if path == deepest]
    error = found[0]
    param = ".".join(deepest).replace(".[", "[") or None
    if param is None and error.get("type") in (  # no body, or not an object
            "missing", "model_attributes_type", "model_type", "dict_type"):
        message = ("the request needs a JSON object as its body, sent with the header "
                   "`Content-Type: application/json`, e.g. {\"model\": \"...\", "
                   "\"prompt\": \"...\"} (chat: \"messages\" instead of \"prompt\")")
    elif error.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif error.get("type") == "json_invalid":
        message = "We could not parse the JSON body of your request: send valid JSON"
    elif error.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    else:  # a field's value, or the body's as a whole (a check across fields)
        saids = list(dict.fromkeys(expected(e) for e in found))
        said = ", or ".join([saids[0], *(re.sub(r"^Input should be ", "", other)
                                         for other in saids[1:])])
        message = f"{param}: {said}" if param else said
    return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)


def field_path(error: Any, body: Any) -> list[str]:
    """Where in the request ``error`` is: the parts of pydantic's ``loc`` that name keys
    and indices of ``body`` (and the field found missing), each index as ``[i]``."""
    loc = [part for part in error.get("loc", ()) if part != "body"]
    path: list[str] = []
    node = body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            path.append(str(part))
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(f"[{part}]")
            node = node[part]
        elif i == len(loc) - 1 and error.get("type") == "missing":
            path.append(str(part))
        # else: pydantic's name for a union's member, or "[key]": no part of the request
    return path


def expected(error: Any) -> str:
    """What pydantic says a value should be, in a client's words: one of our objects
    by its shape, without pydantic's parsing details or its "Value error, "."""
    if error.get("type") in ("model_type", "model_attributes_type"):  # pydantic's words
        # ours, by its shape where pydantic names it (a union's member)
        names = [(error.get("ctx") or {}).get("class_name"), *reversed(error.get("loc", ()))]
        model = next((getattr(schema, name) for name in names if isinstance(name, str)
                      and isinstance(getattr(schema, name, None), type)
                      and issubclass(getattr(schema, name), BaseModel)), None)
        return "Input should be an object" + (f" {shape(model)}" if model else "")
    said = re.sub(r"^(Value error|Assertion failed), ", "", str(error.get("msg")))
    return re.sub(r", unable to parse .*$", "", said)


def shape(model: type[BaseModel]) -> str:
    """An object of a request model, its required fields only: ``{"type": "function",
    "function": {"name": ...}}``."""
    parts = []
    for name, info in model.model_fields.items():
        if not info.is_required():
            continue
        kind, args = info.annotation, get_args(info.annotation)
        value = (json.dumps(args[0]) if get_origin(kind) is Literal and len(args) == 1
                 else shape(kind) if isinstance(kind, type) and issubclass(kind, BaseModel)
                 else "...")
        parts.append(f'"{info.alias or name}": {value}')
    return "{" + ", ".join(parts) + "}"
