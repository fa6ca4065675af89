"""The seed's JSON shape (``/v1/sessions``), for clients that bring their own drafter.

    POST   /v1/sessions                {mode, temperature, top_k, top_p, seed}
                                       -> 201 {session_id, mode, max_draft, width, max_context}
    POST   /v1/sessions/{id}/prefill   {token_ids} -> {total_tokens}
    POST   /v1/sessions/{id}/verify    {draft_tokens, draft_probs?}
                                       -> {accepted_prefix_len, preds, next_token,
                                           total_tokens, verify_ms}
    DELETE /v1/sessions/{id}           -> 204

The server keeps each session's history (what was prefilled, then every verdict's tokens)
and passes it whole to :class:`~spececd.transports.unary.UnarySessions`, which feeds the target
only what its KV cache lacks; so the limits, typed errors, batching and metrics are the
engine's. A session idle for the engine's idle timeout is forgotten (404: create another
and prefill its history). In exact mode a draft needs ``draft_probs``, the sparse
distribution each token was sampled from: without it a verdict would be biased, so it is
refused (400 ``invalid_probabilities``), never guessed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from spececd.cloud.service import CloudService
from spececd.core.sampling import SparseProbs
from spececd.protocol.errors import InvalidProbabilities, OutOfOrder, ServerBusy, UnknownSession
from spececd.transports.http.common import ERRORS, HttpError, TokenDep
from spececd.transports.unary import UnaryParams, UnarySessions

# Token ids are bounded here only so that they encode; the engine checks the vocabulary.
TokenId = Annotated[int, Field(ge=0, lt=2**32, description="a token id of the target's "
                                                         "vocabulary")]


class SessionParams(BaseModel):
    """A session's verification mode and sampling parameters, which the target applies
    exactly as the client's drafter does."""

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
    width: int = Field(description="drafted tokens the server verifies in one pass, at most: "
                       "how far to send drafts that cost nothing to draft (a lookup, a "
                       "prediction of the output)")
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


@dataclass
class JsonSession:
    params: UnaryParams
    history: list[int] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time
    last_used: float = field(default_factory=time.monotonic)

    @property
    def exact(self) -> bool:
        return self.params.mode == "exact" and self.params.temperature > 0


class Sessions:
    """The JSON sessions of one engine, by their unguessable ids."""

    def __init__(self, engine: CloudService) -> None:
        self.engine = engine
        self.unary = UnarySessions(engine)
        self.sessions: dict[str, JsonSession] = {}

    def create(self, params: SessionParams) -> SessionCreated:
        self._expire()
        limit = self.engine.policy.max_sessions
        if len(self.sessions) >= limit or not self.engine.ready():
            raise HttpError(ServerBusy(f"the server holds its maximum of {limit} sessions; "
                                       f"try again later"))
        session_id = secrets.token_urlsafe(16)
        self.sessions[session_id] = JsonSession(UnaryParams(
            params.mode, params.temperature, params.top_k, params.top_p, params.seed))
        limits = self.engine.limits
        return SessionCreated(session_id=session_id,
                              mode="greedy" if params.temperature == 0 else params.mode,
                              max_draft=limits.max_draft, width=limits.width,
                              max_context=limits.max_context)

    def get(self, session_id: str) -> JsonSession:
        self._expire()
        session = self.sessions.get(session_id)
        if session is None:
            raise HttpError(UnknownSession(
                f"no such session (never created, deleted, or idle longer than "
                f"{self.engine.policy.idle_timeout:g} s); create one and prefill its history"))
        session.last_used = time.monotonic()
        return session

    async def prefill(self, session_id: str, token: str, token_ids: Sequence[int]) -> int:
        """Append ``token_ids`` to the history and run the target over them now, so the
        next verify finds them in its KV cache. (The target's token after them is not
        kept; its draw depends on its position only, so nothing later changes.)"""
        session = self.get(session_id)
        async with session.lock:
            history = [*session.history, *token_ids]
            await self.unary.verify(session_id, token, session.params, history, (), ())
            session.history = history
            return len(history)

    async def verify(self, session_id: str, token: str, body: VerifyBody) -> Verified:
        session = self.get(session_id)
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

    async def delete(self, session_id: str, token: str) -> None:
        if self.sessions.pop(session_id, None) is None:
            raise HttpError(UnknownSession("no such session"))
        await self.unary.close(session_id, token)

    def _expire(self) -> None:
        """Forget the sessions idle longer than the engine's idle timeout (their engine
        links, idle as long, have ended)."""
        cutoff = time.monotonic() - self.engine.policy.idle_timeout
        for session_id, session in list(self.sessions.items()):
            if session.last_used < cutoff and not session.lock.locked():
                del self.sessions[session_id]

    def close_all(self) -> None:
        self.unary.close_all()


async def _sessions(request: Request) -> Sessions:
    sessions: Sessions = request.app.state.sessions
    return sessions


SessionsDep = Annotated[Sessions, Depends(_sessions)]
router = APIRouter(prefix="/v1", tags=["sessions"], responses=ERRORS)


@router.post("/sessions", status_code=201)
async def create_session(params: SessionParams, sessions: SessionsDep,
                         _: TokenDep) -> SessionCreated:
    """Open a session for a client that drafts on its own."""
    return sessions.create(params)


@router.post("/sessions/{session_id}/prefill")
async def prefill(session_id: str, body: PrefillBody, sessions: SessionsDep,
                  token: TokenDep) -> Prefilled:
    """Append tokens to the session's history (the prompt first) and run the target over
    them."""
    return Prefilled(total_tokens=await sessions.prefill(session_id, token, body.token_ids))


@router.post("/sessions/{session_id}/verify")
async def verify(session_id: str, body: VerifyBody, sessions: SessionsDep,
                 token: TokenDep) -> Verified:
    """Verify a draft continuing the session's history; the kept tokens and the target's
    own are appended to it."""
    return await sessions.verify(session_id, token, body)


@router.delete("/sessions/{session_id}", status_code=204, response_class=Response)
async def delete_session(session_id: str, sessions: SessionsDep, token: TokenDep) -> Response:
    """End the session."""
    await sessions.delete(session_id, token)
    return Response(status_code=204)
