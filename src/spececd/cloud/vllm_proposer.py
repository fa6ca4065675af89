"""The edge's drafts inside vLLM: a speculative proposer that proposes what the edges sent.

vLLM loads :class:`HintProposer` by name (``speculative_config={"method": "custom_class",
"model": "spececd.cloud.vllm_proposer.HintProposer", ...}``) in the process that runs the
model, and calls :meth:`HintProposer.propose` after every engine step. The server
(:mod:`spececd.cloud.vllm`) publishes each request's drafted tokens on a local ZeroMQ
channel (the address is in ``$SPECECD_HINTS``); the proposer reads what has arrived without
waiting and proposes, for every request in the batch, the drafted tokens that follow the
request's tokens so far, when the draft agrees with them. A draft that is late, unknown or
contradicted proposes nothing: the step then generates one token of the target's own, and
the engine is never held up.

This module imports nothing of SpecECD's and nothing heavy: it runs inside vLLM's worker.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import zmq

log = logging.getLogger(__name__)

ADDRESS_ENV = "SPECECD_HINTS"


def request_key(engine_request_id: str) -> str:
    """The server's request id of one of vLLM's: vLLM appends ``-<8 hex digits>`` to the
    id it was given, and the server's ids have no ``-`` of their own."""
    return engine_request_id.split("-", 1)[0]


def proposal(tokens: np.ndarray, start: int, draft: Sequence[int], limit: int) -> list[int]:
    """The drafted tokens after ``tokens`` (a request's tokens so far, prompt included),
    for a draft of the positions from ``start`` on: empty unless the draft agrees with
    every token it covers."""
    n = len(tokens)
    if start > n or n - start > len(draft):
        return []
    if n > start and list(tokens[start:n]) != list(draft[:n - start]):
        return []
    return list(draft[n - start:n - start + limit])


class HintProposer:
    """vLLM's ``custom_class`` proposer; see the module docstring. The channel's messages
    are msgpack lists: ``[request id, start, tokens]`` sets a request's draft,
    ``[request id]`` forgets it."""

    def __init__(self, vllm_config: Any) -> None:
        self.limit = int(vllm_config.speculative_config.num_speculative_tokens)
        self.drafts: dict[str, tuple[int, list[int]]] = {}
        self._runner: Any = None
        address = os.environ.get(ADDRESS_ENV)
        if not address:
            raise RuntimeError(f"${ADDRESS_ENV} is not set: this proposer serves `spececd "
                               f"serve --engine vllm`, which sets it")
        # Every process that runs the model (one per tensor-parallel rank) hears every draft.
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)

    def load_model(self, model: Any) -> None:
        """Called by vLLM's CPU model runner; there is no model to load."""

    def _receive(self) -> None:
        while True:
            try:
                message = msgpack.unpackb(self._socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if len(message) == 1:
                self.drafts.pop(message[0], None)
            else:
                self.drafts[message[0]] = (int(message[1]), list(message[2]))

    def _request_ids(self) -> list[str] | None:
        """The ids of the batch's rows. vLLM passes them to no proposer, so they are read
        from the model runner that calls :meth:`propose` (its ``input_batch.req_ids``):
        the caller's ``self``."""
        if self._runner is None:
            frame: FrameType | None = sys._getframe(2)
            for _ in range(4):
                if frame is None:
                    break
                caller = frame.f_locals.get("self")
                if caller is not None and hasattr(caller, "input_batch"):
                    self._runner = caller
                    break
                frame = frame.f_back
            else:
                log.error("the vLLM model runner was not found above the proposer; "
                          "edge drafts are not used (this vLLM version is not supported)")
                self._runner = False
        if not self._runner:
            return None
        return list(self._runner.input_batch.req_ids)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, **_: Any) -> list[list[int]]:
        self._receive()
        ids = self._request_ids() if self.drafts else None
        if ids is None:
            return [[] for _ in sampled_token_ids]
        out: list[list[int]] = []
        for row in range(len(sampled_token_ids)):
            draft = self.drafts.get(request_key(ids[row])) if row < len(ids) else None
            if draft is None:
                out.append([])
                continue
            n = int(num_tokens_no_spec[row])
            out.append(proposal(token_ids_cpu[row, :n], draft[0], draft[1], self.limit))
        return out
