"""What the edge needs from a transport: move whole frames, in order, both ways.

The edge states the interface here, in its own layer, and each transport's client
(:mod:`spececd.transports`) implements it, so the edge imports no transport.

Every edge connection also carries an affinity key, :data:`AFFINITY_HEADER` (gRPC
metadata: its lowercase form), fresh for each connection: a load balancer in front of
several verifier replicas hashes on it so that every request of an HTTP link reaches the
replica that holds the link, while new connections, and reconnections after a replica
failed or drained, spread over the replicas. A WebSocket connection or a gRPC stream is
pinned by being one connection or stream; the key costs them nothing and lets one hash
rule cover every transport.
"""

from __future__ import annotations

import secrets
from typing import Protocol

AFFINITY_HEADER = "SpecECD-Affinity"


def affinity_key() -> str:
    """A new connection's affinity key: random, so connections spread over replicas."""
    return secrets.token_hex(8)


class Transport(Protocol):
    """A connection to the verifier, as the edge uses it; each transport's client
    implements it. ``bytes_sent``, ``bytes_received``: what crossed it so far."""

    bytes_sent: int
    bytes_received: int

    def send(self, frame: bytes) -> None:
        """Send one whole frame (raises ``ConnectionError`` when the connection is gone)."""

    def recv(self) -> bytes:
        """The next frame, waiting for it (raises ``ConnectionError`` when the connection is
        lost or nothing came within the transport's wait)."""

    def poll(self) -> bytes | None:
        """A frame that has already arrived, or None; never waits."""

    def close(self) -> None:
        """Close the connection: nothing more is sent or received on it."""
