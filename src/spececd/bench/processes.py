"""The processes `spececd bench` and `spececd bench load` measure with, started and
waited on through :mod:`spececd.bench.child` (every start and load time logged, every wait
under the stall limit): the verifier server (``spececd serve`` on the target's device and
dtype), vLLM's own OpenAI server, and the bench's workers (:mod:`spececd.bench.worker`).
Each runs in a process group of its own, so that stopping it stops what it started."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spececd.backends.registry import model_format
from spececd.bench.api import free_port
from spececd.bench.child import STALL_S, ChildFailed, ChildLines, Stalled, kill
from spececd.processes import bound

if TYPE_CHECKING:
    from spececd.bench.runner import BenchConfig

log = logging.getLogger(__name__)


def resolved_dtype(dtype: str, device: str, model: str) -> str:
    """What ``dtype`` is for the transformers ``model`` on ``device`` (auto: its own where
    the device computes it natively, :mod:`spececd.backends.dtypes`; a GPU this machine
    lacks falls back to the CPU), by the backend's own rule."""
    from spececd.backends.hf import resolve_device, resolve_dtype

    return str(resolve_dtype(dtype, resolve_device(device), model)).removeprefix("torch.")


def label(model: str) -> str:
    """A model's short name in logs and rows: a folder's or a file's name."""
    path = Path(model)
    return path.name if path.suffix == ".gguf" else path.name or model


class Worker:
    """A :mod:`spececd.bench.worker` process, ``what`` in every log line and error. It
    writes a line after each prompt, so the stall limit applies to each prompt, not to a
    whole pass."""

    COMMAND = (sys.executable, "-m", "spececd.bench.worker")

    def __init__(self, job: dict[str, Any], what: str, stall_s: float = STALL_S,
                 wait: bool = True) -> None:
        """Start the worker on ``job``; with ``wait``, return once it has loaded (else
        :meth:`loaded` waits, so that several workers load at once)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.started = time.perf_counter()
        self.what = what
        self.proc = subprocess.Popen(bound(self.COMMAND),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, start_new_session=True)
        assert self.proc.stdout is not None
        self.lines = ChildLines(self.proc, self.proc.stdout, what, stall_s)
        self.ready = False
        log.info("%s: loading", what)
        try:
            self._send(job)
        except BaseException:
            self.close()
            raise
        if wait:
            self.loaded()

    def loaded(self) -> None:
        """Wait until the worker has loaded its models (stopping it if it fails to)."""
        try:
            assert self._read("loading").get("ready")
        except BaseException:
            self.close()
            raise
        self.ready = True
        log.info("%s: loaded in %.1f s", self.what, time.perf_counter() - self.started)

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it exited: reading says so, with its last lines
            pass

    def _read(self, doing: str) -> dict[str, Any]:
        """The next reply, past progress lines and anything a library printed."""
        while True:
            line = self.lines.next(doing)
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            if isinstance(reply, dict) and "progress" not in reply:
                return reply

    def run(self, request: dict[str, Any], doing: str = "measuring"
            ) -> list[dict[str, Any]]:
        self._send(request)
        return self._read(doing)["results"]  # type: ignore[no-any-return]

    def close(self) -> None:
        """End the worker: one that has loaded ends when its input closes; one still
        loading (another process failed first) reads nothing until it has, so it is
        stopped at once."""
        if not self.ready:
            kill(self.proc)
            return
        if self.proc.stdin:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            kill(self.proc)


# One core for the server, whichever its engine: the built-in one runs one torch thread,
# vLLM's CPU build one OpenMP thread bound to core 0 (and 2 GiB of KV cache).
SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
              "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}


def server_command(cfg: BenchConfig, transports: tuple[str, ...] = ("websocket",)
                   ) -> list[str]:
    """``spececd serve`` for ``cfg.target`` on ``cfg.device`` in ``cfg.dtype``, one torch
    thread, a listener for each of ``transports``, and ``cfg.token_budget`` where set."""
    ports = {"websocket": "--port", "grpc": "--grpc-port", "http": "--http-port"}
    listen = [arg for name in ("websocket", "grpc", "http")
              for arg in (ports[name], str(cfg.port) if name in transports else "-1")]
    # vLLM: 16 draft slots per step at most (vLLM reserves them per request)
    engine = ["--engine", "vllm", "--max-draft", "16"] if cfg.engine == "vllm" else []
    if cfg.token_budget is not None:
        engine += ["--token-budget", cfg.token_budget]
    return [sys.executable, "-m", "spececd", "serve", "--target-model", cfg.target, "--host",
            cfg.host, *listen, "--device", cfg.device, "--threads", "1",
            "--dtype", cfg.dtype, "--max-batch", str(cfg.max_batch), "--max-sessions", "256",
            *engine]


class Server:
    """``spececd serve`` (:func:`server_command`), started on construction; :meth:`ports`
    waits until it serves, so that the bench's workers load meanwhile."""

    def __init__(self, cfg: BenchConfig, transports: tuple[str, ...] = ("websocket",)
                 ) -> None:
        self.what = f"the verifier server ({label(cfg.target)}, {cfg.engine} engine" + (
            f", token budget {cfg.token_budget})" if cfg.token_budget is not None else ")")
        log.info("%s: starting on %s%s", self.what, cfg.device,
                 f" in {resolved_dtype(cfg.dtype, cfg.device, cfg.target)}"
                 if model_format(cfg.target) == "hf" else "")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(bound(server_command(cfg, transports)),
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **SERVER_ENV}, start_new_session=True)
        assert self.proc.stderr is not None
        self.lines = ChildLines(self.proc, self.proc.stderr, self.what, cfg.stall_s)
        self._ports: dict[str, int] | None = None

    def ports(self) -> dict[str, int]:
        """Each transport's port, once the server says it is serving (it is stopped if it
        fails to). Its stderr is read and dropped from then on."""
        if self._ports is not None:
            return self._ports
        try:
            while "serving" not in (line := self.lines.next("starting")):
                pass
        except BaseException:
            kill(self.proc)
            raise
        self.lines.discard()
        log.info("%s: serving after %.1f s", self.what, time.perf_counter() - self.started)
        schemes = {"ws": "websocket", "grpc": "grpc", "http": "http"}
        self._ports = {schemes[scheme]: int(port) for scheme, port
                       in re.findall(r"(\w+)://[\w.]+:(\d+)", line)}
        return self._ports


def start_server(cfg: BenchConfig, transports: tuple[str, ...] = ("websocket",)
                 ) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """``spececd serve`` (:class:`Server`); the process and each transport's port, once it
    says it is serving."""
    server = Server(cfg, transports)
    return server.proc, server.ports()


def start_openai_server(target: str, draft: str, k: int, max_batch: int,
                        dtype: str = "float32", stall_s: float = STALL_S
                        ) -> tuple[subprocess.Popen[str], str]:
    """vLLM's own OpenAI server for ``target`` in ``dtype``, speculating with ``draft``
    in-process (the ``draft_model`` method, ``k`` tokens): the process and its URL, once it
    answers (within ``stall_s``, else :class:`~spececd.bench.child.Stalled`)."""
    import urllib.request

    port = free_port()
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    proc = subprocess.Popen(
        bound([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
               "--served-model-name", target, "--dtype", dtype, "--host", "127.0.0.1",
               "--port", str(port), "--max-num-seqs", str(max_batch),
               "--speculative-config", json.dumps(config)]),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **SERVER_ENV}, start_new_session=True)
    assert proc.stderr is not None
    what = "vLLM's OpenAI server"
    lines = ChildLines(proc, proc.stderr, what, stall_s)  # its last lines, should it exit
    lines.discard()
    url = f"http://127.0.0.1:{port}"
    log.info("%s: starting", what)
    started = time.monotonic()
    while time.monotonic() < started + stall_s:
        if proc.poll() is not None:
            last = "\n  ".join(lines.tail)
            raise ChildFailed(f"{what} exited with status {proc.returncode} while starting; "
                              f"its last lines:\n  {last}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            log.info("%s: serving after %.1f s", what, time.monotonic() - started)
            return proc, url
        except OSError:
            time.sleep(1)
    kill(proc)
    raise Stalled(f"{what} did not answer within {stall_s:g} s (--stall-timeout sets the "
                  "limit)")
