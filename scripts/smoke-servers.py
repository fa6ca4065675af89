"""Every server the console commands run, started as a user starts it, with one real request
of each: what CI runs in the README's first install (`.ci/run`), so that a dependency that
install lacks fails there and not on a user's machine.

- ``spececd serve`` on WebSocket, gRPC and HTTP at once (ports chosen by the server), and
  ``spececd generate --server`` against each: every edge gets its tokens, and their greedy
  outputs are equal;
- ``spececd api`` (the default pair in one process): a chat completion with a
  ``json_schema`` response format (xgrammar) whose reply parses and holds the schema's
  keys, and a forced tool call (``tool_choice: required``) whose arguments parse.

Only the standard library and the ``spececd`` command of the environment it runs in (its
``PATH``); every process it starts, it ends (SIGTERM to the process group, then SIGKILL),
whatever fails and on SIGTERM or SIGINT to itself. Prints one line per check and exits 1 at
the first failure, with the server's log. Usage (from the repository's root)::

    python scripts/smoke-servers.py
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

START_TIMEOUT = 300  # seconds for a server to load its models and say it serves
REQUEST_TIMEOUT = 300  # seconds for one generation (a first request compiles, loads)
STOP_TIMEOUT = 20  # seconds between SIGTERM and SIGKILL

PROCESSES: list[subprocess.Popen[str]] = []


class Server:
    """A console command that serves, started in a process group of its own; ``urls``:
    what its "serving ..." line names."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.log: list[str] = []
        self.proc = subprocess.Popen(["spececd", *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        PROCESSES.append(self.proc)
        self.serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.serving.wait(START_TIMEOUT)
        serving = [line for line in self.log if line.startswith("spececd: serving")]
        if not serving:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)  # its stderr closed: its status, once it has one
            why = (f"ended with status {self.proc.poll()}" if self.proc.poll() is not None
                   else f"did not say it serves within {START_TIMEOUT} s")
            fail(f"`spececd {' '.join(args)}` {why}", self)
        self.urls = re.findall(r"\b(?:wss?|grpcs?|https?)://[\w.:\[\]-]+", serving[0])

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if line.startswith("spececd: serving"):
                self.serving.set()
        self.serving.set()  # it ended: the wait is over (and the check above fails)

    def url(self, scheme: str) -> str:
        found = [url for url in self.urls if url.startswith(f"{scheme}://")]
        if not found:
            fail(f"`spececd {' '.join(self.args)}` serves no {scheme}:// URL: {self.urls}",
                 self)
        return found[0]


def stop_all() -> None:
    """SIGTERM to every process group started, then SIGKILL to what is left of them."""
    for proc in PROCESSES:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for proc in PROCESSES:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            print(f"smoke: {proc.args} did not end on SIGTERM: killed", file=sys.stderr)
        # the group too: whatever the command started that is still there
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    PROCESSES.clear()


def fail(message: str, server: Server | None = None) -> None:
    if server is not None:
        print("\n".join(server.log[-40:]), file=sys.stderr)
    raise SystemExit(f"smoke: FAILED: {message}")


def check(ok: bool, message: str, server: Server | None = None) -> None:
    if not ok:
        fail(message, server)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            answer: dict[str, Any] = json.load(response)
            return answer
    except urllib.error.HTTPError as exc:
        fail(f"POST {url}: {exc.code} {exc.read().decode(errors='replace')}")
        raise


def edges(server: Server, workdir: Path) -> None:
    """``spececd generate --server`` against each transport: greedy, the same tokens."""
    outputs: dict[str, list[int]] = {}
    for scheme in ("ws", "grpc", "http"):
        url = server.url(scheme)
        started = time.perf_counter()
        result = subprocess.run(
            ["spececd", "generate", "--server", url, "--prompt", "def fibonacci(n):",
             "--max-tokens", "16", "--temperature", "0", "--json"],
            capture_output=True, text=True, timeout=REQUEST_TIMEOUT, cwd=workdir,
            start_new_session=True, check=False)
        check(result.returncode == 0, f"spececd generate --server {url}: "
              f"{result.stderr[-2000:]}", server)
        (completion,) = json.loads(result.stdout)["completions"]
        stats = json.loads(result.stdout)["stats"]
        check(len(completion["token_ids"]) > 0 and stats["rounds"] > 0,
              f"spececd generate --server {url} generated nothing: {result.stdout}", server)
        outputs[scheme] = completion["token_ids"]
        print(f"smoke: spececd generate --server {url}: {len(completion['token_ids'])} "
              f"tokens in {stats['rounds']} rounds, acceptance "
              f"{stats.get('acceptance_rate', 0):.2f} ({time.perf_counter() - started:.1f} s)")
    check(len({tuple(ids) for ids in outputs.values()}) == 1,
          f"the transports' greedy outputs differ: {outputs}", server)
    print("smoke: the three transports' greedy outputs are equal")


POINT = {"type": "object", "properties": {
    "label": {"type": "string", "maxLength": 12},
    "x": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["label", "x"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def api(server: Server) -> None:
    """A structured output and a forced tool call through ``spececd api``."""
    base = server.url("http") + "/v1"
    reply = post(f"{base}/chat/completions", {
        "model": "spececd", "messages": [{"role": "user", "content": "A point, please."}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "point", "schema": POINT, "strict": True}},
        "temperature": 0, "max_tokens": 64})
    content = reply["choices"][0]["message"]["content"]
    check(reply["choices"][0]["finish_reason"] == "stop", f"not whole: {reply}", server)
    point = json.loads(content, strict=False)  # xgrammar's strings may hold raw controls
    check(isinstance(point, dict) and set(point) == {"label", "x"}
          and isinstance(point["x"], int), f"not the schema's object: {content!r}", server)
    print(f"smoke: spececd api: json_schema chat completion: {content}")
    reply = post(f"{base}/chat/completions", {
        "model": "spececd",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 64})
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"], strict=False)
    check(call["function"]["name"] == "get_weather" and isinstance(arguments.get("city"), str)
          and reply["choices"][0]["finish_reason"] == "tool_calls",
          f"not a get_weather call: {reply}", server)
    print(f"smoke: spececd api: forced tool call: get_weather({call['function']['arguments']})")


def main() -> None:
    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(f"smoke: stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="spececd-smoke-") as workdir:
            serve = Server("serve", "--port", "0", "--grpc-port", "0", "--http-port", "0")
            print(f"smoke: spececd serve: {' '.join(serve.urls)}")
            edges(serve, Path(workdir))
            stop_all()
            api_server = Server("api", "--port", "0")
            print(f"smoke: spececd api: {api_server.urls[0]}")
            api(api_server)
    finally:
        stop_all()
    print(f"smoke: every server answered ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
