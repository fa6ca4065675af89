"""A server's processes end with it: ``spececd serve`` stopped by SIGTERM at each stage of
start-up and serving exits, and no process it started is left running a few seconds later.

Every process below the server is recorded from its start until the signal (a process whose
parent dies is re-parented to init, so it must be seen before). vLLM's engine runs in
processes of its own (``VLLM::EngineCore``, then ``VLLM::Worker``), which a server killed
by SIGTERM's default action mid start-up left running (3.7 GB); the built-in engine starts
none, and must still stop at once at every stage. The vLLM stages start a server each (about
a minute apiece on two cores): they run with ``-m slow``. SIGKILL, which runs nothing of the
server's, is checked with vLLM, whose processes bind themselves to their parents; the
binding itself is checked without vLLM in tests/test_processes.py."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import MODELS, requires_default_pair
from tests.proctree import HAS_PROC, Process, command, running, tree

pytestmark = [requires_default_pair,
              pytest.mark.skipif(not HAS_PROC, reason="processes are read from /proc (Linux)")]

TARGET = MODELS / "target"
# vLLM on core 0 with a small KV cache, eager (compiling would add a minute to each start)
VLLM = ("--engine", "vllm", "--engine-args", '{"enforce_eager": true}')
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
            "VLLM_LOGGING_LEVEL": "WARNING"}


class Server:
    """``spececd serve`` on the default target, or another ``command``; ``processes``: every
    process seen below it."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None,
                 command: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spececd", "-v",
             *(command or ("serve", "--target-model", str(TARGET), "--device", "cpu",
                           "--dtype", "float32", "--port", "0", *extra))],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.started = time.monotonic()
        self.log: list[str] = []
        self.serving = threading.Event()
        self.processes: dict[Process, str] = {}  # with its command line when last seen
        threading.Thread(target=self._read, daemon=True).start()

    def _record(self) -> None:
        for process in tree(self.proc.pid):
            self.processes[process] = command(process) or self.processes.get(process, "")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if "spececd: serving" in line:
                self.serving.set()

    def stop_when(self, stage: Callable[[Server], bool], timeout: float,
                  signum: int = signal.SIGTERM) -> int:
        """``signum`` once ``stage`` holds; the exit status, once every process below it
        ended."""
        deadline = time.monotonic() + timeout
        while not stage(self):
            self._record()
            assert self.proc.poll() is None, f"exited before the stage: {''.join(self.log)}"
            assert time.monotonic() < deadline, f"stage not reached: {''.join(self.log)}"
            time.sleep(0.05)
        self._record()
        self.proc.send_signal(signum)
        status = self.proc.wait(120)
        deadline = time.monotonic() + 10  # what ends once the server has gone (pipes closed)
        while (left := [p for p in self.processes if running(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, (f"left running: {[self.processes[p][:60] for p in left]}; "
                          f"server's stderr: {''.join(self.log[-20:])}")
        return status

    def kill(self) -> None:
        """After a failed test: SIGKILL to the server and everything seen below it."""
        if self.proc.poll() is None:
            self.proc.kill()
        for pid, _ in [p for p in self.processes if running(p)]:  # not a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def after(seconds: float) -> Callable[[Server], bool]:
    return lambda server: time.monotonic() - server.started >= seconds


def starting(server: Server) -> bool:
    """The server is starting: it catches SIGTERM (``ended_with_this_one`` is in force:
    SIGTERM's bit in ``SigCgt``), and does not serve yet. That holds from before the target
    loads until "serving"; waiting for the load itself or the engine check raced them, as
    the default target loads and checks within one poll at times (seen in CI)."""
    try:
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines()
                   if line.startswith("SigCgt:")), 0)
    return bool(caught >> (signal.SIGTERM - 1) & 1) and not server.serving.is_set()


def below(name: str) -> Callable[[Server], bool]:
    """A process whose command line holds ``name`` runs below the server."""
    return lambda server: any(name in command(p) for p in tree(server.proc.pid))


def serving(server: Server) -> bool:
    return server.serving.is_set()


@pytest.mark.parametrize(("stage", "status"), [
    pytest.param(starting, 143, id="starting"),  # SIGTERM raised SystemExit(128 + 15)
    pytest.param(serving, 0, id="serving"),  # drained
])
def test_the_builtin_engine_stops_at_every_stage(stage: Callable[[Server], bool],
                                                 status: int) -> None:
    server = Server("--engine", "builtin", "--threads", "1")
    try:
        got = server.stop_when(stage, 120)
        assert got == status, f"exit status {got}; stderr: {''.join(server.log[-20:])}"
    finally:
        server.kill()


def test_the_bench_ends_its_servers_with_it(tiny_models: dict[str, Path],
                                            tmp_path: Path) -> None:
    """``spececd bench`` runs its servers in sessions of their own: SIGTERM's default action
    left the one it had started serving (its workers ended as their pipes closed)."""
    server = Server(command=(
        "bench", "--draft-model", str(tiny_models["draft"]), "--target-model",
        str(tiny_models["llama"]), "--num-prompts", "2", "--max-tokens", "16",
        "--out", str(tmp_path / "out")))
    try:
        # once its server serves: its workers have started
        got = server.stop_when(below("spececd.bench.worker"), 120)
        assert got == 143, f"exit status {got}; stderr: {''.join(server.log[-20:])}"
    finally:
        server.kill()


vllm_installed = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                    reason="vLLM is not installed (bash scripts/install-vllm.sh)")


@pytest.mark.slow
@vllm_installed
@pytest.mark.parametrize(("stage", "status", "seen"), [
    # before SpecECD's handler (SIGTERM's default action) or just after: nothing started yet
    pytest.param(after(0.5), None, "", id="importing"),
    # vLLM's engine process importing, before it names itself
    pytest.param(below("multiprocessing.spawn"), 143, "multiprocessing.spawn",
                 id="engine-core"),
    pytest.param(below("VLLM::Worker"), 143, "VLLM::Worker", id="worker"),  # loading the model
    pytest.param(serving, 0, "VLLM::Worker", id="serving"),
    # SIGINT alone (not a terminal's Ctrl-C, which reaches vLLM's processes too): vLLM's
    # start-up swallowed KeyboardInterrupt and went on to serve
    pytest.param(below("VLLM::Worker"), 130, "VLLM::Worker", id="worker-sigint"),
])
def test_the_vllm_engine_ends_with_the_server_at_every_stage(
        stage: Callable[[Server], bool], status: int | None, seen: str) -> None:
    signum = signal.SIGINT if status == 130 else signal.SIGTERM
    server = Server(*VLLM, env=VLLM_ENV)
    try:
        got = server.stop_when(stage, 400, signum)
        assert got in ((-signal.SIGTERM, 143) if status is None else (status,)), (
            f"exit status {got}; stderr: {''.join(server.log[-20:])}")
    finally:
        server.kill()
    assert any(seen in name for name in server.processes.values()) or not seen


@pytest.mark.slow
@vllm_installed
@pytest.mark.parametrize("stage", [
    pytest.param(below("VLLM::Worker"), id="worker"),  # the worker loading the model
    pytest.param(serving, id="serving"),
])
def test_the_vllm_engine_ends_with_a_sigkilled_server(stage: Callable[[Server], bool]) -> None:
    """SIGKILL runs nothing of the server's: vLLM's engine process and its worker end by
    themselves (bound to their parents: spececd.cloud.vllm_executor), where vLLM 0.32 left
    them running, with the model's memory."""
    server = Server(*VLLM, env=VLLM_ENV)
    try:
        got = server.stop_when(stage, 400, signal.SIGKILL)
        assert got == -signal.SIGKILL, f"exit status {got}"
    finally:
        server.kill()
    assert any("VLLM::Worker" in name for name in server.processes.values())
