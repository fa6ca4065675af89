"""What the edge needs from a transport: move whole frames, in order, both ways."""

from __future__ import annotations

from typing import Protocol


class Transport(Protocol):
    bytes_sent: int
    bytes_received: int

    def send(self, frame: bytes) -> None: ...
    def recv(self) -> bytes: ...
    def poll(self) -> bytes | None:
        """A frame that has already arrived, or None; never waits."""
        ...
    def close(self) -> None: ...
