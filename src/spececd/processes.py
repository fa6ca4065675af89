"""The processes a command starts end with it.

vLLM runs its engine in processes of its own (``VLLM::EngineCore``, which starts
``VLLM::Worker``). vLLM's shutdown ends them when the server closes its engine, but a server
that dies of a signal's default action while the engine starts, before there is an engine
to close, left them running under init (3.7 GB with the default target on a CPU; on a GPU
they would hold its memory). So a command that starts such processes runs within
:func:`ended_with_this_one`:

- SIGTERM and SIGINT raise ``SystemExit(128 + signal)`` in the main thread, so that
  ``finally`` blocks and the engine's own shutdown run at any point of start-up. Not
  ``KeyboardInterrupt`` for SIGINT: vLLM's start-up swallows that one and goes on starting
  (``vllm.utils.network_utils.zmq_socket_ctx`` in vLLM 0.32). An event loop may take
  SIGTERM over while it runs (to drain); ``asyncio.run`` gives it back to the default
  action when it returns, so the command calls :func:`exit_on_signals` again before it
  closes the engine.
- On the way out, whatever this process started within it that still runs is ended
  (:func:`end_descendants`): a snapshot of every descendant first, since a process whose
  parent dies is re-parented to init and is no longer found below this one; then SIGTERM,
  and SIGKILL for those left after a grace period. Processes that were there before are
  spared (a caller in a test process keeps its own servers).

Descendants are found by walking ``/proc/*/stat`` (Linux; elsewhere none are found and only
the signal handling applies). multiprocessing's resource tracker is left alone: it ignores
SIGTERM, ends by itself once every process that uses it has ended, and cleans up what they
leaked.

Nothing in a command helps against SIGKILL of the command itself: there the processes it
started end themselves. A child calls :func:`end_with_parent` as it starts, and the kernel
sends it SIGKILL when its parent ends (Linux's ``PR_SET_PDEATHSIG``; elsewhere it does
nothing). vLLM's processes call it through :mod:`spececd.cloud.vllm_executor` (its engine
process) and the proposer (its workers).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from types import FrameType
from typing import NoReturn

STOPPING = (signal.SIGTERM, signal.SIGINT)
RESOURCE_TRACKER = b"multiprocessing.resource_tracker"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = logging.getLogger(__name__)


def exit_now(code: int) -> NoReturn:
    """End a command's process with ``code`` once the command has returned: the
    ``atexit`` handlers run (logging's, multiprocessing's, temporary directories', torch's),
    the standard streams are flushed, and the interpreter's teardown of every loaded module
    is skipped (``os._exit``). With torch and transformers loaded that teardown took about
    a second of every command's end on two cores: a server's SIGTERM to its exit went from
    1.4 s to 0.12 s.

    What an ordinary exit also does and this one does not: it waits for threads that are
    not daemons, and runs threading's own exit hooks (the shutdown of
    ``concurrent.futures``' idle workers). A command returns once its work is done and what
    it started has ended (:func:`ended_with_this_one`), so nothing is cut short there.

    Output that cannot be flushed (a closed pipe, a full disk) makes the exit code 120,
    as an ordinary exit does, where the command had succeeded: its output was lost."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception as exc:
            code = code or 120
            with contextlib.suppress(OSError):  # fd 2 itself may be the one gone
                os.write(2, f"spececd: could not write its output: {exc}\n".encode())
    os._exit(code)


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_signals() -> None:
    """SIGTERM and SIGINT raise ``SystemExit(128 + signal)`` in the main thread from now
    on."""
    for signum in STOPPING:
        signal.signal(signum, _exit)


@contextlib.contextmanager
def ended_with_this_one(grace: float = 3.0) -> Iterator[None]:
    """Within: SIGTERM and SIGINT raise ``SystemExit``; on leaving, however it is left, every
    descendant started within and still running is ended (``grace``: seconds between
    SIGTERM and SIGKILL). For a command's main thread (only it may set signal handlers)."""
    before = set(descendants())
    previous = {signum: signal.getsignal(signum) for signum in STOPPING}
    exit_on_signals()
    try:
        yield
    finally:
        # A signal during the (bounded) ending is ignored, rather than stopping it halfway.
        for signum in STOPPING:
            signal.signal(signum, signal.SIG_IGN)
        try:
            end_descendants(grace, spare=before)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


Process = tuple[int, bytes]  # a pid and its start time: the same pid later is another process


def descendants(pid: int = 0) -> list[Process]:
    """Every process below ``pid`` (0: this one), parents before their children."""
    children: dict[int, list[Process]] = {}
    with contextlib.suppress(FileNotFoundError):  # no /proc: none found
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                fields = _stat(int(entry.name))
                if fields is not None:
                    # fields from the 3rd on (after "pid (name)"): the parent is the 4th,
                    # the start time the 22nd
                    children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found, todo = [], [pid or os.getpid()]
    while todo:
        for child in children.get(todo.pop(0), ()):
            found.append(child)
            todo.append(child[0])
    return found


def end_descendants(grace: float = 3.0, spare: Collection[Process] = ()) -> list[int]:
    """End every process below this one but those in ``spare``: SIGTERM, then SIGKILL for
    those still running after ``grace`` seconds (and any started meanwhile). Returns the
    pids it signalled."""
    first = _ending(spare)
    if first:
        log.info("ending the %d processes this one started that still run", len(first))
    _signal(first, signal.SIGTERM, grace)
    left = [p for p in {*first, *_ending(spare)} if _running(p)]
    if left:
        log.warning("killing %d processes that did not end within %g s of SIGTERM",
                    len(left), grace)
    _signal(left, signal.SIGKILL, 1.0)
    return sorted({pid for pid, _ in (*first, *left)})


def _ending(spare: Collection[Process]) -> list[Process]:
    return [p for p in descendants()
            if p not in spare and not _is_resource_tracker(p[0]) and _running(p)]


def _signal(processes: list[Process], signum: int, wait: float) -> None:
    """``signum`` to each of ``processes``, then up to ``wait`` seconds for them to end."""
    for pid, _ in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    deadline = time.monotonic() + wait
    while any(_running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stat(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` from its 3rd field on, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()  # the name, in parentheses, may hold spaces


def _running(process: Process) -> bool:
    fields = _stat(process[0])
    # a zombie has ended (this process, or init once this one exits, collects it)
    return fields is not None and fields[19] == process[1] and fields[0] != b"Z"


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return RESOURCE_TRACKER in f.read()
    except OSError:
        return False


def end_with_parent(parent: int | None = None) -> bool:
    """This process gets SIGKILL when its parent ends, however the parent ends (SIGKILL
    too), and at once if the parent has ended already. ``parent``: the pid it expects as
    its parent, by default its multiprocessing parent's; a process with neither (a command
    started from a shell: vLLM run in the server's own process) is left alone. Linux only
    (``PR_SET_PDEATHSIG``). Returns whether it is bound; elsewhere it does nothing.

    The kernel sends the signal when the *thread* that started this process ends: the
    parent must start such a child from a thread that lives as long as it does (its main
    thread). The flag is not inherited by this process's own children: each sets its own.
    """
    if parent is None:
        spawner = multiprocessing.parent_process()
        parent = spawner.pid if spawner is not None else None
    if parent is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        log.warning("could not bind this process to its parent's life (prctl: %s)",
                    os.strerror(errno))
        return False
    if os.getppid() != parent:  # it ended before the flag was set
        log.warning("the parent process %d has ended: ending this one", parent)
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def bound(command: Sequence[str]) -> list[str]:
    """``command`` started so that it ends with this process, SIGKILL of this one included:
    through ``python -m spececd.processes PID COMMAND...``, which binds itself to this
    process (:func:`end_with_parent`) and then becomes the command (the kernel's flag
    outlives ``exec``). For children that are not this project's Python (vLLM's server,
    llama.cpp's binaries) as for those that are. Only from the main thread: the kernel
    ends the child when the *thread* that started it ends (:func:`end_with_parent`), so a
    command started from another thread (a test restarting a server from a helper thread)
    runs unbound, ended by its caller as before."""
    if threading.current_thread() is not threading.main_thread():
        return list(command)
    return [sys.executable, "-m", "spececd.processes", str(os.getpid()), *command]


if __name__ == "__main__":
    end_with_parent(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
