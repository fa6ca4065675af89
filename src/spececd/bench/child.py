"""Waiting on the bench's child processes and measurements, never silently and never
forever.

Every wait of ``spececd bench`` and ``spececd bench load`` goes through here: a server's
start (its stderr until "serving"), a worker's load and each of its replies (its stdout,
one JSON line per prompt or pass) and a measurement run in a thread. Each wait has a stall
limit: when the thing waited on shows no progress (no line, no result) within it, it is
stopped and :class:`Stalled` names it, so that a run that hangs (a model that never
finishes loading on a GPU, a server that stops answering) ends with the name of the
process that hung instead of printing nothing. A child that exits is an error that quotes
the last lines it wrote. The bench starts its children in process groups of their own
(``start_new_session``), so that stopping one stops what it started too (a worker's
``spececd api``, vLLM's engine processes).

What this module knows nothing about: what the lines mean. Callers decide which line is
"ready" or "serving" and log the load times (:mod:`spececd.bench.runner`).
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

from spececd.errors import SpecECDError

T = TypeVar("T")

STALL_S = 600.0  # the default stall limit: a GPU model's load, or a long pass, fits in it


class Stalled(SpecECDError):
    """A child process or a measurement showed no progress within the stall limit."""


class ChildFailed(SpecECDError):
    """A child process exited while the bench waited on it."""


def kill(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` and, where it leads a process group of its own, every process in it."""
    try:
        if hasattr(os, "killpg") and os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:  # it has just exited
        pass
    proc.wait()


class ChildLines:
    """The lines a child writes on one of its pipes, read by a thread of their own, so
    that a wait for the next one can end at the stall limit. ``what`` names the child in
    every error ("the verifier server for models/target"); the last lines are kept for
    them."""

    def __init__(self, proc: subprocess.Popen[str], stream: IO[str], what: str,
                 stall_s: float = STALL_S) -> None:
        self.proc, self.what, self.stall_s = proc, what, stall_s
        self.tail: collections.deque[str] = collections.deque(maxlen=8)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._keep = True
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.tail.append(line.rstrip("\n"))
            if self._keep:
                self._lines.put(line)
        self._lines.put(None)

    def next(self, doing: str) -> str:
        """The child's next line; ``doing`` says what it was doing ("loading", "pass 2")
        for the error when none comes within the stall limit (the child is then killed)
        or the child ends."""
        try:
            line = self._lines.get(timeout=self.stall_s)
        except queue.Empty:
            kill(self.proc)
            raise Stalled(f"{self.what} showed no progress for {self.stall_s:g} s while "
                          f"{doing}; stopped it (--stall-timeout sets the limit)") from None
        if line is None:
            code = self.proc.wait()
            last = "\n  ".join(self.tail)
            raise ChildFailed(f"{self.what} exited with status {code} while {doing}"
                              + (f"; its last lines:\n  {last}" if last else ""))
        return line

    def discard(self) -> None:
        """From now on the lines are read and dropped (a server's log once it serves), so
        that the child never blocks on a full pipe; the last ones stay in :attr:`tail`."""
        self._keep = False


def within(what: str, stall_s: float, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` in a thread of its own, its result or its exception; :class:`Stalled`
    naming ``what`` if it has not finished after ``stall_s`` seconds (the thread is left
    to end with the process: a measurement blocked on a hung server cannot be
    interrupted)."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(work(*args))
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(stall_s)
    if thread.is_alive():
        raise Stalled(f"{what} did not finish within {stall_s:g} s "
                      f"(--stall-timeout sets the limit)")
    if failed:
        raise failed[0]
    return done[0]
