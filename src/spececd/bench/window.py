"""The measured window of a `spececd bench load` row: when its clients start, when the
window opens and closes (:class:`Window`, shared by client threads and draft processes),
what each client received (:class:`ClientResult`), and the figures of what arrived in the
window (:func:`window_figures`), with whether it was steady.

The window opens ``warmup_s`` after every client has had its first token, so the
start-up, when every prompt is prefilled at once, is outside it; only outputs that
arrived in it count. It is steady when every client had joined before it opened, it held
a whole generation per client (every session prefilled its next prompt in it, as in the
steady state: the clients generate again and again), and its halves' tokens/s are within
:data:`STEADY_SPREAD` of each other.

What this module knows nothing about: clients, servers and drafting
(:mod:`spececd.bench.load`), and tables (:mod:`spececd.bench.load_report`).
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WARMUP_S = 5.0  # seconds from the last client's first token to the measured window
RAMP_S = 10.0  # arrival "stagger": client i of N starts i * RAMP_S / N seconds in
ARRIVALS = ("all", "stagger")
STEADY_SPREAD = 0.2  # a steady window's halves: tokens/s at most this share apart


class Window:
    """A row's schedule, shared by its clients (threads here, or draft processes: values in
    shared memory, on the system-wide monotonic clock). The bench starts the schedule once
    every client is ready (a draft process: its model loaded); client ``i`` starts at its
    offset from then; each counts itself joined at its first token. Once all have joined,
    the measured window opens after the warm-up and closes ``duration`` later, and the
    clients stop there."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready, self._joined, self._left = (ctx.Value("i", 0) for _ in range(3))
        self._start, self._close = ctx.Value("d", math.inf), ctx.Value("d", math.inf)

    def ready(self) -> None:
        with self._ready.get_lock():
            self._ready.value += 1

    def join(self) -> None:
        with self._joined.get_lock():
            self._joined.value += 1

    def leave(self) -> None:
        """A client failed: the schedule no longer waits for it."""
        with self._left.get_lock():
            self._left.value += 1

    @property
    def counts(self) -> tuple[int, int, int]:
        """Clients ready, clients that have had their first token, clients that failed."""
        return self._ready.value, self._joined.value, self._left.value

    def start(self) -> float:
        self._start.value = time.monotonic()
        return float(self._start.value)

    def wait_start(self, offset: float) -> None:
        while self._start.value == math.inf:
            time.sleep(0.01)
        time.sleep(max(0.0, self._start.value + offset - time.monotonic()))

    @property
    def closes(self) -> float:
        return float(self._close.value)

    def close_at(self, when: float) -> None:
        self._close.value = when


@dataclass
class ClientResult:
    """What one client received: each output as (when it arrived, on the monotonic clock;
    seconds since the one before, or for a generation's first since the request; its
    tokens; whether it was a generation's first), and its generations' drafted and accepted
    tokens."""

    events: list[tuple[float, float, int, bool]] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def record(self, when: float, seconds: float, tokens: int, first: bool) -> None:
        self.events.append((when, seconds, tokens, first))


def percentiles(values: Sequence[float], qs: Sequence[float] = (0.5, 0.95, 0.99)
                ) -> dict[str, float] | None:
    """``values`` (seconds) at each quantile, in milliseconds; None where there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return {f"p{round(100 * q)}": round(1000 * ordered[min(len(ordered) - 1,
                                                             int(q * len(ordered)))], 2)
            for q in qs}


def window_figures(results: Sequence[ClientResult], opened: float, closed: float,
                   max_tokens: int, joined: int) -> dict[str, Any]:
    """The client-side figures of the outputs that arrived in [``opened``, ``closed``): tokens/s
    (the server's, a median client's, each half's), time to first token of the generations
    that began there, the latency of the rounds of sessions already decoding (between one
    output and the next: a round, or for cloud-only a token) and per token, and whether the
    window was steady (``steady_note`` says why not): every client had its first token
    before it opened (``joined`` of them did), it held at least a whole generation per
    client (``max_tokens`` each: every session went through its next prompt's prefill in
    it), and its halves' tokens/s are within :data:`STEADY_SPREAD` of each other."""
    seconds = closed - opened
    middle = opened + seconds / 2
    inside = [e for r in results for e in r.events if opened <= e[0] < closed]
    tokens = sum(e[2] for e in inside)
    halves = [round(sum(e[2] for e in inside if (e[0] < middle) == first) / (seconds / 2), 2)
              for first in (True, False)]
    decoding = [e for e in inside if not e[3]]
    clients = len(results)
    reasons = []
    if joined < clients:
        reasons.append(f"{clients - joined} of {clients} clients had no first token before "
                       "the window")
    if tokens < clients * max_tokens:
        reasons.append(f"{tokens} tokens in the window, under a generation per client "
                       f"({clients * max_tokens})")
    if max(halves) and (max(halves) - min(halves)) / max(halves) > STEADY_SPREAD:
        reasons.append(f"its halves' tokens/s {halves[0]:g} and {halves[1]:g} differ by "
                       f"more than {STEADY_SPREAD:.0%}")
    return {
        "server_tokens_per_s": round(tokens / seconds, 2),
        "client_tokens_per_s": round(statistics.median(
            sum(e[2] for e in r.events if opened <= e[0] < closed) / seconds
            for r in results), 2) if results else 0.0,
        "halves_tokens_per_s": halves,
        "ttft_ms": percentiles([e[1] for e in inside if e[3]]),
        "round_latency_ms": percentiles([e[1] for e in decoding]),
        "token_latency_ms": percentiles([e[1] / e[2] for e in decoding if e[2]
                                         for _ in range(e[2])]),
        "generations": sum(1 for e in inside if e[3]),
        "tokens": tokens,
        "steady": not reasons,
        "steady_note": "; ".join(reasons) or None,
    }
