"""In-memory transport: the edge talks to a verifier in the same process, through the same
frames and session state machines as over a network. Used by in-process generation."""

from __future__ import annotations

from collections import deque

from spececd.cloud.verifier import VerifierService


class MemoryTransport:
    def __init__(self, service: VerifierService) -> None:
        self._connection = service.connect()
        self._inbox: deque[bytes] = deque()
        self.bytes_sent = 0
        self.bytes_received = 0

    def send(self, frame: bytes) -> None:
        self.bytes_sent += len(frame)
        self._inbox.extend(self._connection.receive(frame))  # runs the verifier to the end

    def recv(self) -> bytes:
        if not self._inbox:
            raise ConnectionError("the in-process verifier sent nothing back")
        frame = self._inbox.popleft()
        self.bytes_received += len(frame)
        return frame

    def close(self) -> None:
        self._connection.close()
