"""gRPC transport (``grpcio``): the service ``spececd.v1.VerificationService`` of
``spececd.proto``, both sides.

Server: :func:`serve` puts an :class:`~spececd.cloud.service.CloudService` behind a ``grpc.aio``
server on the running event loop.

- ``Session`` (bidirectional stream) is one engine link, exactly like a WebSocket
  connection: each request message's ``data`` goes into the link, each reply goes back as
  a response message. Every mode, stream drafting, resume and the Hello's auth token work
  as over WebSocket because the frames are the same; the auth token may come as metadata
  ``authorization: Bearer TOKEN`` instead of in the hello. How the link ended is the call's
  trailing metadata ``spececd-ending``; a session that closed ends with OK, one that idled
  out or was refused (the server was full) with UNAVAILABLE.
- ``VerifyDraft`` and ``BatchVerify`` (unary, for clients that bring their own drafter) go
  through :class:`~spececd.transports.unary.UnarySessions`: the prefix comes in full each call,
  and calls with the same ``session_id`` reuse one link and its KV cache. The strategies
  are the seed's names for our modes (:data:`STRATEGIES`); ``threshold`` is lossy and every
  response says so. Auth: metadata ``authorization: Bearer TOKEN``. A rejected call ends
  with the status of :data:`STATUS` for its error, the SpecECD error code in trailing
  metadata ``spececd-error-code`` and a message that says what to do.

Client: :class:`GrpcTransport`, a blocking transport for the edge loop over one
``Session`` stream (``grpc://host:port`` or ``grpcs://host:port``). Every way the link
can fail surfaces as ``ConnectionError``, which the edge answers by reconnecting and
re-sending its history.

Health, readiness, status and metrics are served on the WebSocket port only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import queue
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import grpc
import numpy as np
from grpc import aio

from spececd.cloud.service import CloudService, Ending
from spececd.core.params import Mode
from spececd.core.sampling import SparseProbs
from spececd.edge.transport import AFFINITY_HEADER, affinity_key
from spececd.protocol.errors import InvalidProbabilities, ProtocolError, UnexpectedMessage
from spececd.transports import spececd_pb2 as pb
from spececd.transports import spececd_pb2_grpc as pb_grpc
from spececd.transports.unary import UnaryParams, UnarySessions

GRPC_OVERHEAD = 64 * 1024  # room above the session's message limit before gRPC refuses
CLOSE_WAIT = 1.0  # seconds close() lets the server end the stream before cancelling it
POLLER_EXIT_S = 0.5  # seconds close() waits for grpcio's connectivity poller (it polls 0.2 s)

# The seed's strategy names for our verification modes.
STRATEGIES = {"deterministic": Mode.MATCH, "probabilistic": Mode.EXACT,
              "greedy": Mode.GREEDY, "threshold": Mode.THRESHOLD}

Code = grpc.StatusCode
STATUS = {
    "malformed_frame": Code.INVALID_ARGUMENT, "unexpected_message": Code.INVALID_ARGUMENT,
    "invalid_tokens": Code.INVALID_ARGUMENT, "invalid_probabilities": Code.INVALID_ARGUMENT,
    "limit_exceeded": Code.INVALID_ARGUMENT, "out_of_order": Code.INVALID_ARGUMENT,
    "version_mismatch": Code.FAILED_PRECONDITION,
    "incompatible_models": Code.FAILED_PRECONDITION,
    "auth_failed": Code.UNAUTHENTICATED, "server_busy": Code.UNAVAILABLE,
    "verification_failed": Code.INTERNAL,
}
_ADVICE = {"auth_failed": "; send the server's token as metadata 'authorization: Bearer TOKEN'"}


# -- server ---------------------------------------------------------------------------


async def _abort(context: Any, exc: ProtocolError, where: str = "") -> NoReturn:
    await context.abort(STATUS.get(exc.code, Code.UNKNOWN),
                        f"{where}{exc}{_ADVICE.get(exc.code, '')}",
                        (("spececd-error-code", exc.code),))
    raise AssertionError("unreachable: abort raises")


def _bearer(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _float32(value: float) -> float:
    """A proto ``float`` as the shortest decimal that rounds to it (0.7, not 0.69999998)."""
    return float(str(np.float32(value)))


def _unary_call(request: Any) -> tuple[str, UnaryParams, tuple[SparseProbs, ...] | None]:
    """A request's strategy, session parameters and draft distributions, checked."""
    strategy = request.strategy or "deterministic"
    mode = STRATEGIES.get(strategy)
    if mode is None:
        raise UnexpectedMessage(f"unknown strategy {strategy!r}: use one of "
                                f"{', '.join(STRATEGIES)}")
    temperature = 0.0 if mode is Mode.GREEDY else _float32(request.temperature)
    top_p = request.top_p if request.HasField("top_p") else 1.0
    params = UnaryParams(mode.value, temperature, request.top_k, top_p, request.seed,
                         request.threshold)
    if mode is not Mode.EXACT or temperature == 0:
        return strategy, params, None  # verified by token ids alone
    k = len(request.draft_token_ids)
    if len(request.draft_probs) != k:
        raise InvalidProbabilities(
            f"strategy 'probabilistic' needs draft_probs, the distribution each drafted token "
            f"was sampled from (ids and probabilities of its support), one per drafted token: "
            f"got {len(request.draft_probs)} for {k} tokens. draft_logprobs cannot replace "
            f"them (the residual distribution needs the whole draft distribution); send "
            f"draft_probs, or use strategy 'deterministic', which needs token ids only")
    dists = []
    for i, dist in enumerate(request.draft_probs):
        if len(dist.token_ids) != len(dist.probs):
            raise InvalidProbabilities(f"draft_probs[{i}] has {len(dist.token_ids)} token_ids "
                                       f"and {len(dist.probs)} probs; give one of each per "
                                       f"token of the support")
        dists.append(SparseProbs(np.asarray(dist.token_ids, dtype=np.int64),
                                 np.asarray(dist.probs, dtype=np.float32)))
    return strategy, params, tuple(dists)


class _Servicer:
    """The service's handlers (registered by name; generated base classes are untyped)."""

    def __init__(self, engine: CloudService) -> None:
        self.engine = engine
        self.unary = UnarySessions(engine)

    async def Session(self, requests: AsyncIterator[Any], context: Any) -> None:
        # The token in the metadata authorizes the link; without it (or with a wrong one)
        # the hello's token is checked, and a wrong one answered with a typed error frame.
        link = self.engine.open(authorized=hmac.compare_digest(
            _bearer(context).encode(), self.engine.auth_token.encode()))

        async def frames() -> AsyncIterator[bytes]:
            # A client may half-close (done writing) and still read its answers; a call
            # that fails instead is a client gone (a cancelled call cancels this handler).
            try:
                async for request in requests:
                    yield request.data
            except (aio.AioRpcError, aio.UsageError):
                link.leave()

        async def send(frame: bytes) -> None:
            await context.write(pb.Frame(data=frame))

        ending = await self.engine.run(link, frames(), send, half_close=True)
        metadata: list[tuple[str, str]] = [("spececd-ending", ending.value)]
        refusals = {Ending.REFUSED: "server_busy", Ending.DRAINED: "draining"}
        if ending in refusals:
            metadata.append(("spececd-error-code", refusals[ending]))
        context.set_trailing_metadata(tuple(metadata))
        details = {Ending.IDLE: "the session idled out; reconnect and resume",
                   Ending.REFUSED: "the server is full; try later",
                   Ending.DRAINED: "the server is shutting down; reconnect and resume"}
        if ending in details:
            context.set_code(Code.UNAVAILABLE)
            context.set_details(details[ending])

    async def _verify(self, request: Any, token: str) -> Any:
        strategy, params, dists = _unary_call(request)
        draft = tuple(request.draft_token_ids)
        verdict = await self.unary.verify(request.session_id, token, params,
                                          tuple(request.prefix_token_ids), draft, dists)
        accepted = verdict.num_accepted
        return pb.VerificationResponse(
            num_accepted_tokens=accepted,
            acceptance_mask=[i < accepted for i in range(len(draft))],
            corrected_token_ids=[*draft[:accepted], verdict.next_token],
            next_token_id=verdict.next_token, total_tokens=verdict.total_tokens,
            verify_s=verdict.verify_s, lossy=verdict.lossy, strategy=strategy,
            session_id=request.session_id)

    async def VerifyDraft(self, request: Any, context: Any) -> Any:
        try:
            return await self._verify(request, _bearer(context))
        except ProtocolError as exc:
            await _abort(context, exc)

    async def BatchVerify(self, request: Any, context: Any) -> Any:
        token = _bearer(context)
        # Concurrently: the engine verifies what is queued together in one target pass.
        results = await asyncio.gather(*(self._verify(r, token) for r in request.requests),
                                       return_exceptions=True)
        responses = []
        for i, result in enumerate(results):
            if isinstance(result, ProtocolError):
                await _abort(context, result, f"requests[{i}]: ")
            if isinstance(result, BaseException):
                raise result
            responses.append(result)
        return pb.BatchVerificationResponse(responses=responses)


async def serve(engine: CloudService, host: str, port: int, tls: tuple[str, str] | None = None,
                ready: Callable[[int], None] | None = None,
                request_timeout: float = 0.0) -> None:
    """Serve until cancelled. ``tls``: paths of a PEM certificate (chain) and its key.
    ``ready`` is called with the bound port (so ``port=0`` picks a free one). Raises
    ``OSError`` when the address cannot be bound. ``request_timeout`` is taken for the
    listeners' common signature: gRPC's HTTP/2 keepalive covers a stalled client."""
    limit = engine.limits.max_message_bytes + GRPC_OVERHEAD
    server = aio.server(options=[("grpc.max_receive_message_length", limit),
                                 ("grpc.max_send_message_length", limit),
                                 ("grpc.so_reuseport", 0)])  # a port in use is an error
    servicer = _Servicer(engine)
    pb_grpc.add_VerificationServiceServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            cert, key = (Path(path).read_bytes() for path in tls)
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    except RuntimeError:  # gRPC says no more than that the bind failed
        raise OSError(errno.EADDRINUSE, f"gRPC could not bind {address} (in use, or not an "
                                        f"address of this machine)") from None
    await server.start()
    try:
        if ready is not None:
            ready(bound)
        await server.wait_for_termination()
    finally:
        servicer.unary.close_all()
        await server.stop(grace=None)


# -- client ---------------------------------------------------------------------------


def message_bytes(frame: int) -> int:
    """Bytes a frame of ``frame`` bytes takes as one gRPC message of ``Frame``: the 5-byte
    message prefix (compression flag, length) and the protobuf field (a 1-byte tag, the
    length as a varint, the data; nothing for an empty frame). Not counted: HTTP/2 frame
    headers (9 bytes per DATA frame), the call's HEADERS frames, pings and window updates,
    TLS records, TCP/IP."""
    field = 0 if frame == 0 else 1 + (frame.bit_length() + 6) // 7 + frame
    return 5 + field


def _target(url: str) -> tuple[bool, str, str, int]:
    """``grpc[s]://host:port`` as (secure, gRPC target, host, port); ValueError if bad."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad server URL {url!r}: {exc}") from None
    if parts.scheme not in ("grpc", "grpcs") or not parts.hostname or port is None \
            or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"bad server URL {url!r}: use grpc://host:port or grpcs://host:port")
    host = parts.hostname
    return parts.scheme == "grpcs", f"[{host}]:{port}" if ":" in host else f"{host}:{port}", \
        host, port


def _await_poller(channel: grpc.Channel) -> None:
    """Wait for the thread grpcio started for the channel's ``subscribe`` to end. It outlives
    an ``unsubscribe`` by up to one poll (0.2 s), and one still polling when the channel
    closes raises in its thread, "Cannot monitor channel state: Channel closed!"
    (grpc/grpc#18995), which CI showed after a link closed as soon as it opened. The poller's
    state is grpcio's own attribute: where a version lacks it, nothing is waited for."""
    state = getattr(channel, "_connectivity_state", None)
    deadline = time.monotonic() + POLLER_EXIT_S
    while getattr(state, "polling", False) and time.monotonic() < deadline:
        time.sleep(0.005)


class GrpcTransport:
    """A blocking client link to a verifier over one ``Session`` stream.

    A reader thread moves replies into a queue, so :meth:`recv` can time out and
    :meth:`poll` never waits. ``bytes_sent`` and ``bytes_received`` count
    :func:`message_bytes` per frame. ``cafile``: PEM roots to trust for ``grpcs://``
    (default: gRPC's bundled roots); ``verify=False`` trusts whatever certificate the
    server presents (fetched when connecting, checked against nothing; its name must
    still match the host).
    """

    def __init__(self, url: str, *, cafile: str | None = None, verify: bool = True,
                 auth_token: str = "", open_timeout: float = 10.0,
                 recv_timeout: float = 120.0, max_size: int = 16 << 20) -> None:
        self.url = url
        self.recv_timeout = recv_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        secure, target, host, port = _target(url)
        options = [("grpc.max_receive_message_length", max_size),
                   ("grpc.max_send_message_length", max_size), ("grpc.enable_http_proxy", 0)]
        try:
            if secure:
                roots = (Path(cafile).read_bytes() if cafile else None if verify else
                         ssl.get_server_certificate((host, port), timeout=open_timeout).encode())
                self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots),
                                                    options)
            else:
                self._channel = grpc.insecure_channel(target, options)
        except (OSError, ssl.SSLError) as exc:  # the CA file, or fetching the certificate
            raise ConnectionError(f"cannot connect to {url}: {exc}") from exc
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # pb.Frame; None: end
        self._inbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None: ended
        self._arrived = 0
        self._failure = ""
        self._ended = threading.Event()
        self._closed = False
        connected = threading.Event()

        def watch(state: grpc.ChannelConnectivity) -> None:
            if state is grpc.ChannelConnectivity.READY:
                connected.set()

        self._channel.subscribe(watch, try_to_connect=True)
        # Fail-fast: a channel that cannot connect ends the call at once, saying why.
        metadata = ((AFFINITY_HEADER.lower(), affinity_key()),
                    *((("authorization", f"Bearer {auth_token}"),) if auth_token else ()))
        self._call = pb_grpc.VerificationServiceStub(self._channel).Session(
            self._requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, args=(connected,), daemon=True,
                                        name="spececd-grpc-reader")
        self._reader.start()
        in_time = connected.wait(open_timeout)
        self._channel.unsubscribe(watch)
        if not in_time or (self._ended.is_set() and not self._arrived):
            self.close()
            raise ConnectionError(f"cannot connect to {url}: "
                                  f"{self._failure or f'no connection in {open_timeout:g} s'}")

    def _requests(self) -> Iterator[Any]:
        while (frame := self._outbox.get()) is not None:
            yield frame

    def _read(self, connected: threading.Event) -> None:
        try:
            for reply in self._call:
                self._arrived += 1
                self._inbox.put(reply.data)
            self._failure = "the server ended the session"
        except grpc.RpcError as exc:
            self._failure = f"{exc.code().name}: {exc.details()}"
        finally:
            self._ended.set()
            self._inbox.put(None)
            connected.set()  # wakes the constructor if it is still waiting

    def send(self, frame: bytes) -> None:
        if self._closed or self._ended.is_set():
            raise ConnectionError(f"connection to {self.url} lost: "
                                  f"{self._failure or 'closed'}")
        self._outbox.put(pb.Frame(data=frame))
        self.bytes_sent += message_bytes(len(frame))

    def recv(self) -> bytes:
        try:
            frame = self._inbox.get(timeout=self.recv_timeout)
        except queue.Empty:
            raise ConnectionError(f"connection to {self.url} lost: no reply in "
                                  f"{self.recv_timeout:g} s") from None
        return self._received(frame)

    def poll(self) -> bytes | None:
        """A frame that has already arrived, or None; never waits."""
        try:
            frame = self._inbox.get_nowait()
        except queue.Empty:
            return None
        return self._received(frame)

    def _received(self, frame: bytes | None) -> bytes:
        if frame is None:
            self._inbox.put(None)  # every later call fails the same way
            raise ConnectionError(f"connection to {self.url} lost: {self._failure}")
        self.bytes_received += message_bytes(len(frame))
        return frame

    def close(self) -> None:
        """End the stream (the server then ends the session) and the channel."""
        with contextlib.suppress(Exception):  # closing a broken link must not raise
            if self._closed:
                return
            self._closed = True
            self._outbox.put(None)
            self._ended.wait(CLOSE_WAIT)
            self._call.cancel()
            _await_poller(self._channel)
            self._channel.close()
