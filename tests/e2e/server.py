"""Run `spececd serve` as a real subprocess on loopback, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from spececd import processes


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held at once while chosen, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


STATIC_ENV = "SPECECD_TESTS_STATIC_PATH"  # set by pytest --static-path (tests/conftest.py)
# A listener for every transport beside WebSocket's (each on a port of the system's choice)
ALL_LISTENERS = ("--grpc-port", "0", "--http-port", "0")


class ServerProcess:
    """``spececd serve`` (or another serving ``command``, such as ``api``) on 127.0.0.1, run
    by ``python`` (default: this one); started on construction, stopped by :meth:`stop`.
    ``urls``: the URL of every transport it opened, by scheme (``ws``, ``grpc``, ``http``,
    with ``s`` under TLS); ``url`` is the one of ``scheme`` on ``port``."""

    def __init__(self, target: Path | str | None, *extra: str, port: int | None = None,
                 env: dict[str, str] | None = None, scheme: str = "ws",
                 command: str = "serve", timeout: float = 90.0,
                 python: str = sys.executable) -> None:
        self.target, self.extra, self.env = target, extra, env
        self.command, self.python = command, python
        self.port = port or free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None
        self.log: list[str] = []  # the server's stderr lines
        self.start(timeout)

    def start(self, timeout: float = 90.0) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(self.env or {})}
        # pytest --static-path: a transformers target's server on the static path
        static = (["--static", "on"] if os.environ.get(STATIC_ENV) and self.command == "serve"
                  and "--engine" not in self.extra and Path(str(self.target)).is_dir()
                  and not any(Path(str(self.target)).glob("*.onnx"))
                  and not any(Path(str(self.target)).glob("*.xml")) else [])
        # float32 unless a test asks: the references the tests compare with are float32,
        # and auto is bfloat16 on a CPU with AMX (tests/e2e/test_bfloat16.py covers that)
        dtype = [] if "--dtype" in self.extra else ["--dtype", "float32"]
        # A test's server is stopped when its module ends, with nobody left to drain for:
        # 2 s of grace, not the default's, unless the test drains on purpose
        drain = ([] if "--drain-timeout" in self.extra or self.command != "serve"
                 else ["--drain-timeout", "2"])
        # Bound to this process: a test run killed (its worker SIGKILLed, a timeout) leaves
        # no server behind.
        self.proc = subprocess.Popen(processes.bound(
            [self.python, "-m", "spececd", self.command,
             *(["--target-model", str(self.target)] if self.target else []),
             "--device", "cpu", "--threads", "1", "--port", str(self.port), *static, *dtype,
             *drain, *self.extra]),
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            self.log.append(line)
            if "serving" in line:
                self.urls = {scheme: f"{scheme}://127.0.0.1:{port}" for scheme, port
                             in re.findall(r"(\w+)://[\w.]+:(\d+)", line)}
                # Keep draining stderr: a full pipe would block the server's logging.
                threading.Thread(target=self._drain, args=(self.proc.stderr,),
                                 daemon=True).start()
                return
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: "
                                   f"{''.join(self.log[-10:])}")
        raise RuntimeError("server did not start in time")

    def _drain(self, stream: Any) -> None:
        for line in stream:
            self.log.append(line)

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class NginxProcess:
    """Debian's nginx in the foreground with ``conf`` (a complete nginx.conf, its runtime
    files under ``runtime_dir``); started on construction, stopped by :meth:`stop`."""

    def __init__(self, conf: str, runtime_dir: Path) -> None:
        path = runtime_dir / "nginx.conf"
        path.write_text(conf)
        self.proc = subprocess.Popen(processes.bound(["nginx", "-c", str(path)]),
                                     stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        assert self.proc.stderr is not None
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()
        deadline = time.monotonic() + 10
        while not (runtime_dir / "nginx.pid").exists():  # written once it listens
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {''.join(self.log)}")
            time.sleep(0.05)

    def _drain(self, stream: Any) -> None:
        for line in stream:
            self.log.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # fast shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
