"""The edge's link to the verifier: one transport at a time, kept open across
generations, re-opened when it fails.

Every exchange greets the server first if this session has not greeted on this
connection. When the transport raises ``ConnectionError`` the link drops it, waits
(exponential backoff, :class:`~spececd.edge.options.Reconnect`), connects again, greets
again and asks the caller for the frame anew: the session then re-sends the whole history
as the draft's prefix, and since randomness depends only on (seed, position) the reply is
that of an uninterrupted run. After the last attempt it raises :class:`CloudUnreachable`.
A ``draining`` server is reconnected to at once (a balancer sends the edge to another
replica); every other error the server answers is raised at once, ``engine_failed`` (the
server's engine is gone and the server is exiting) among them: no retry loop.

Bytes moved and the part of each round trip that nothing hid are added to the
generation's statistics here. The link knows nothing about drafting or emitting.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import TypeAlias

from spececd.core.policy import Ema
from spececd.core.stats import GenerationStats
from spececd.edge.options import Reconnect
from spececd.edge.transport import Transport
from spececd.errors import SpecECDError
from spececd.protocol import messages as m
from spececd.protocol.edge_session import EdgeSession
from spececd.protocol.errors import Draining, ProtocolError, VersionMismatch

log = logging.getLogger(__name__)

Reply: TypeAlias = m.Welcome | m.Verdict | m.Tokens


class CloudUnreachable(SpecECDError):
    """The verifier could not be reached, after every reconnection attempt."""


class Link:
    def __init__(self, connect: Callable[[], Transport], reconnect: Reconnect) -> None:
        self.connect = connect
        self.reconnect = reconnect
        self.transport: Transport | None = None  # None: not connected
        self._greeted: EdgeSession | None = None  # the session this connection greeted
        self._checked = False  # this connection carried a hello the server accepted
        # The sequence number of a generation left under way (:meth:`leave_stream`): its
        # Tokens frames that precede the next welcome are skipped.
        self._stale: int | None = None
        self._welcome: m.Welcome | None = None
        # The round trip, from hello to welcome (a generation greets at its start; the
        # server's part of it is a look-up), on connections already open (opening an HTTP
        # link is another round trip): stream drafting reads it.
        self.rtt = Ema(0.0)
        # The lowest hello version the server refused (version_mismatch), if any: every
        # session greets it below that.
        self.refused: int | None = None

    def close(self) -> None:
        """Say goodbye to the server (a ``Close``, when the connection still takes it) and
        drop the connection."""
        if self.transport is not None:
            with contextlib.suppress(ConnectionError):
                self.transport.send(m.encode(m.Close("bye")))
            self.drop()

    def drop(self) -> None:
        """Close the connection without a word; the next exchange connects and greets
        again."""
        if self.transport is not None:
            self.transport.close()
        self.transport, self._greeted = None, None
        self._checked, self._stale = False, None

    @property
    def leaving(self) -> bool:
        """Whether a generation left under way (:meth:`leave_stream`) may still send on
        this connection: no hello has ended it yet."""
        return self._stale is not None

    def leave_stream(self) -> None:
        """Stop reading the generation under way on this connection, to go on otherwise
        (in rounds) from what has arrived: the next exchange greets the server again, which
        ends the stream there (a hello replaces it), and skips the ``Tokens`` frames the
        stream sent before the welcome. Lossless: the tokens kept are a prefix of the
        stream's, cut where the edge chose from what it had received."""
        if self._greeted is not None and (seq := self._greeted.generating) is not None:
            self._stale, self._greeted = seq, None

    def greet(self, session: EdgeSession, stats: GenerationStats) -> m.Welcome:
        """Greet the server with ``session``'s hello (connecting, or reconnecting, as
        needed); its ``Welcome``."""
        welcome = self.exchange(session, None, stats)
        assert isinstance(welcome, m.Welcome)
        return welcome

    def exchange(self, session: EdgeSession, make_frame: Callable[[bool], bytes | None] | None,
                 stats: GenerationStats, while_waiting: Callable[[], None] | None = None
                 ) -> Reply:
        """Greet the server if this session has not, send ``make_frame(greeted_now)`` (None:
        send nothing, a stream is under way), run ``while_waiting`` while the reply is on its
        way, and return the reply (``make_frame`` None: the welcome); reconnect and retry
        when the link fails."""
        failures, failing_since = 0, 0.0
        while True:
            transport = self.transport
            sent = received = 0
            opened = transport is None
            try:
                if transport is None:
                    transport = self.transport = self.connect()
                sent, received = transport.bytes_sent, transport.bytes_received
                greeted_now = self._greeted is not session
                if greeted_now:
                    if self.refused is not None:
                        session.older_server(self.refused)
                    hello = session.hello(checked=self._checked)
                    t0 = time.perf_counter()
                    transport.send(hello)
                    stale, self._stale = self._stale, None
                    try:
                        welcome = session.receive(self._after(transport, stale))
                    except ProtocolError as exc:
                        if stale is not None:
                            # What the stream left may still be in flight (the welcome):
                            # this connection serves no later exchange.
                            self.drop()
                        refused = session.hello_message.protocol_version
                        if not isinstance(exc, VersionMismatch) or not session.older_server():
                            raise
                        self.refused = refused
                        log.info("the server refused protocol %d; greeting it again with %d",
                                 refused, session.hello_message.protocol_version)
                        self.drop()  # the refusal closed the session
                        continue
                    if not opened and stale is None:  # (a stream left: its step in between)
                        self.rtt.update(time.perf_counter() - t0)
                    assert isinstance(welcome, m.Welcome)
                    self._greeted, self._welcome, self._checked = session, welcome, True
                if make_frame is None:
                    assert self._welcome is not None
                    return self._welcome
                start = time.perf_counter()
                frame = make_frame(greeted_now)
                if frame is not None:
                    transport.send(frame)
                overlapped = 0.0
                if while_waiting is not None:
                    t0 = time.perf_counter()
                    while_waiting()
                    overlapped = time.perf_counter() - t0
                reply = session.receive(transport.recv())
                if isinstance(reply, m.Verdict):  # the part of the round trip nothing hid
                    stats.network_s += max(0.0, time.perf_counter() - start - reply.verify_s
                                           - overlapped)
                return reply
            except (ConnectionError, Draining) as exc:
                self.drop()
                failures += 1
                now = time.monotonic()
                failing_since = failing_since or now
                policy = self.reconnect
                if (policy.attempts is not None and failures > policy.attempts) or \
                        now - failing_since > policy.timeout:
                    raise CloudUnreachable(
                        f"cannot reach the verifier ({exc}) after {failures - 1} reconnection "
                        f"attempts in {now - failing_since:.1f} s; check that `spececd serve` "
                        f"runs at that address, or pass --fallback draft") from None
                stats.reconnects += 1
                # A draining server is alive and sends us on: go at once the first time.
                # Otherwise back off, with jitter so that a fleet of edges does not come
                # back in lockstep, and never past the window.
                backoff = min(policy.delay * 2 ** (failures - 1), policy.max_delay)
                wait = 0.0 if isinstance(exc, Draining) and failures == 1 else min(
                    backoff * random.uniform(0.5, 1.0),
                    max(0.0, failing_since + policy.timeout - now))
                log.warning("link to the verifier failed (%s); reconnecting in %.2f s", exc, wait)
                time.sleep(wait)
            finally:
                if transport is not None:
                    stats.bytes_sent += transport.bytes_sent - sent
                    stats.bytes_received += transport.bytes_received - received

    @staticmethod
    def _after(transport: Transport, stale: int | None) -> bytes:
        """The next frame on ``transport`` that is not of the generation ``stale`` (one left
        under way): its ``Tokens``, and an error of one of its steps that left the session
        open (a fatal one is read: the connection ends with it)."""
        while True:
            frame = transport.recv()
            if stale is None:
                return frame
            message = m.decode(frame)
            if not (isinstance(message, m.Tokens | m.Error) and message.seq == stale
                    and not (isinstance(message, m.Error) and message.fatal)):
                return frame

    def send_and_poll(self, session: EdgeSession, frame: bytes,
                      stats: GenerationStats) -> list[Reply]:
        """Send ``frame`` and take whatever has arrived, without waiting. A failed link is
        dropped here and re-established by the next :meth:`exchange`."""
        transport = self.transport
        assert transport is not None and self._greeted is session
        sent, received = transport.bytes_sent, transport.bytes_received
        replies: list[Reply] = []
        try:
            transport.send(frame)
            while (data := transport.poll()) is not None:
                replies.append(session.receive(data))
        except (ConnectionError, Draining) as exc:
            log.warning("link to the verifier failed (%s); reconnecting", exc)
            stats.reconnects += 1
            self.drop()
        finally:
            stats.bytes_sent += transport.bytes_sent - sent
            stats.bytes_received += transport.bytes_received - received
        return replies
