"""SpecECD's binary frames over HTTP (``/v1/links``), for the edge's own transport.

A link is one engine link (:meth:`~spececd.cloud.service.CloudService.open`), served by
:meth:`~spececd.cloud.service.CloudService.serve` in a task like a WebSocket connection, with
the engine's limits and idle timeout:

    POST   /v1/links                       -> 201 {"link_id"}  (503 when full)
    POST   /v1/links/{id}/frames?n&ack&wait   body: one frame  -> replies
    GET    /v1/links/{id}/frames?ack&wait                      -> replies
    DELETE /v1/links/{id}                  -> 204

A response carries every reply queued from number ``ack`` on (each a 4-byte big-endian
length and a frame; the header ``SpecECD-First-Reply`` numbers the first), after waiting
up to ``wait`` seconds for one when there is none, so a draft costs one exchange. Frames
are numbered from 0 (``n``) and replies acknowledged (``ack``), so a request retried on a
new connection is neither applied nor answered twice; without ``n`` a frame is simply the
next, without ``ack`` the replies handed out before are acknowledged. A link that ended
(closed, idle, a fatal error) answers its last replies to any request, applying no frame,
and 404 ``unknown_session`` once they are fetched: the edge opens a new one and re-sends its
history.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, Field

from spececd.cloud.service import CloudService, Link
from spececd.protocol import messages as m
from spececd.protocol.errors import OutOfOrder, UnknownSession, error_for_code
from spececd.transports.http.common import ERRORS, HttpError, TokenDep

MAX_WAIT = 60.0  # seconds a request may wait for a reply; clients long-poll again after
GRACE = 30.0  # seconds an ended link keeps the replies nobody fetched yet
FIRST_REPLY = "SpecECD-First-Reply"


def _gone() -> HttpError:
    return HttpError(UnknownSession("no such link (it ended: closed or idle); open a new "
                                    "link and re-send the history"))


class FrameLink:
    """One edge link: an engine link, and its replies from number ``first`` on (those
    before were acknowledged)."""

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
        """Drop the replies before ``ack``; return the number of the next one and every
        reply from there, waiting up to ``wait`` seconds for one when there is none."""
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
            raise _gone()
        self.handed = self.first + len(self.replies)
        return self.first, list(self.replies)


class Links:
    """The open frame links of one engine, by their unguessable ids."""

    def __init__(self, engine: CloudService) -> None:
        self.engine = engine
        self.links: dict[str, FrameLink] = {}

    def open(self) -> str:
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
        try:  # serves a link deleted before this task ran too: the engine releases it
            return await self.engine.serve(frame_link.link, frame_link.send)
        finally:
            frame_link.ended = True
            frame_link.wake()
            asyncio.get_running_loop().call_later(GRACE, self.links.pop, link_id, None)

    def get(self, link_id: str) -> FrameLink:
        frame_link = self.links.get(link_id)
        if frame_link is None:
            raise _gone()
        return frame_link

    def close(self, link_id: str) -> None:
        self.get(link_id).link.end()
        del self.links[link_id]

    def close_all(self) -> None:
        for frame_link in self.links.values():
            frame_link.link.end()


async def _links(request: Request) -> Links:
    links: Links = request.app.state.links
    return links


LinksDep = Annotated[Links, Depends(_links)]
Wait = Annotated[float, Query(ge=0.0, le=MAX_WAIT, description=(
    "seconds to wait for a reply when none is queued"))]
Ack = Annotated[int | None, Query(ge=0, description=(
    "replies the client has received, i.e. the number of the next one it wants; default: "
    "every reply handed out before"))]
FrameNumber = Annotated[int | None, Query(ge=0, description=(
    "this frame's number on the link, from 0; a number already received is answered but "
    "not applied again; default: the next"))]
_FRAMES: dict[str, Any] = {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_REPLIES: dict[int | str, dict[str, Any]] = {200: {"description": (
    f"the replies from number `{FIRST_REPLY}` (a header) on, each a 4-byte big-endian "
    f"length and a frame"), "content": _FRAMES}}

router = APIRouter(prefix="/v1", tags=["frames"], responses=ERRORS)


def _replies(first: int, replies: list[bytes]) -> Response:
    body = b"".join(len(reply).to_bytes(4, "big") + reply for reply in replies)
    return Response(body, media_type="application/octet-stream",
                    headers={FIRST_REPLY: str(first)})


class LinkCreated(BaseModel):
    link_id: str = Field(description="the link's id: unguessable, used in its URLs")


@router.post("/links", status_code=201)
async def create_link(links: LinksDep, _: TokenDep) -> LinkCreated:
    """Open a link that carries SpecECD's binary frames (the edge's transport)."""
    return LinkCreated(link_id=links.open())


@router.post("/links/{link_id}/frames", response_class=Response, responses=_REPLIES,
             openapi_extra={"requestBody": {"required": True, "content": _FRAMES}})
async def post_frame(link_id: str, request: Request, links: LinksDep, _: TokenDep,
                     wait: Wait = 0.0, ack: Ack = None, n: FrameNumber = None) -> Response:
    """Send one frame; answer every reply queued so far. To a link that has ended, the
    frame is not applied: its last replies are answered while any are left (a fatal error
    that ended it among them), then 404."""
    frame_link = links.get(link_id)
    if frame_link.ended:
        return _replies(*await frame_link.answer(ack, 0.0))
    frame_link.put(await request.body(), n)
    return _replies(*await frame_link.answer(ack, wait))


@router.get("/links/{link_id}/frames", response_class=Response, responses=_REPLIES)
async def get_frames(link_id: str, links: LinksDep, _: TokenDep, wait: Wait = 0.0,
                     ack: Ack = None) -> Response:
    """Long-poll for replies."""
    return _replies(*await links.get(link_id).answer(ack, wait))


@router.delete("/links/{link_id}", status_code=204, response_class=Response)
async def delete_link(link_id: str, links: LinksDep, _: TokenDep) -> Response:
    """End the link."""
    links.close(link_id)
    return Response(status_code=204)
