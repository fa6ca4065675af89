"""`spececd bench load`: N concurrent edge sessions against one verifier server.

Client kinds, labelled in every report:

- ``replay``: clients that run no model. Each knows the target's own continuation of its
  prompt (asked once from the server, cloud-only: greedy, or sampled at ``temperature``
  with the client's seed) and proposes it, replacing each token by a wrong one with
  probability ``1 - acceptance``: verification then accepts each position reached with
  that probability, where the server draws the same tokens for the seed again (the
  built-in engine does, by position; the rows give the acceptance measured, as accepted
  over drafted). Drafting costs nothing, so the server alone bounds the load (a capacity
  run).
- ``replay-stream``: replay clients that stream-draft: the server generates and the client
  sends its (corrupted) continuation ahead as hints, which the server verifies as they
  arrive (on vLLM, the engine's proposer takes them).
- ``draft`` / ``draft-stream``: real drafters, a pool of processes each running the
  draft model, in rounds or by stream drafting.
- ``lookup`` / ``suffix`` (and ``lookup-stream`` / ``suffix-stream``): real drafting
  clients that run no model (:mod:`spececd.edge.lookup`: prompt lookup, suffix drafting),
  the thin-client fleet an operator sees from browsers, phones and agent harnesses. They
  cost next to no CPU, so many run as threads of this process.

- ``vllm-spec``: no edge at all: clients of vLLM's own OpenAI server, which runs the
  target with vLLM's in-process speculative decoding from a draft model on the server
  (``speculative_config`` method ``draft_model``), the setup a user who can fit both
  models on the server would pick instead.

The baseline is the same server generating for the same N users by itself (cloud-only
generation; its decode steps are batched across users by its engine's scheduler).

Each client generates its prompt again and again; the clients start at once or staggered
over a ramp, and a row is measured over a window that opens after every client has had its
first token and a warm-up (:mod:`spececd.bench.window`, which also says whether the window
was steady). Reported, from that window: server tokens/s, per-client tokens/s, time to
first token, round latency of sessions already decoding and per-token latency
percentiles, the batch-size distribution and target forward passes (engine steps) per
generated token (from the server's Prometheus metrics, as differences over the window: the
built-in engine's batch histogram, or vLLM's ``vllm:iteration_tokens_total``).

A curve (:func:`run_curve`) runs every kind at every number of clients, replay clients
at each acceptance asked for, each arrival, on each server in turn (one per token budget);
each row, and the replay clients' traces before them, has the stall limit of
:mod:`spececd.bench.child` on top of its schedule. The tables and plot:
:mod:`spececd.bench.load_report`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from spececd.backends.base import tokenizer_fingerprint
from spececd.bench.child import STALL_S, within
from spececd.bench.load_report import arrival_label, kind_label
from spececd.bench.window import RAMP_S, WARMUP_S, ClientResult, Window, window_figures
from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import TreeShape
from spececd.core.sampling import SparseProbs
from spececd.core.stats import GenerationStats
from spececd.edge.drafter import Tree
from spececd.processes import end_with_parent
from spececd.protocol.messages import Fingerprint

log = logging.getLogger(__name__)


class ReplayDrafter:
    """Proposes the target's own continuation (greedy, or sampled for the client's seed),
    corrupted position by position."""

    forced = 0  # no constraint forces anything here
    looked_up = 0

    def __init__(self, prompt: Sequence[int], trace: Sequence[int], acceptance: float,
                 vocab: int, seed: int) -> None:
        self.prompt, self.trace = list(prompt), list(trace)
        self.acceptance, self.vocab = acceptance, vocab
        self.rng = random.Random(seed)

    def looked_up_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        return ()

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        return None  # it stands for a draft model

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        start = len(history) - len(self.prompt)
        tokens = []
        for token in self.trace[start:start + k]:
            if self.rng.random() >= self.acceptance:
                token = (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            tokens.append(token)
        return tuple(tokens), None


def metrics(*urls: str) -> dict[str, float]:
    """The Prometheus metrics of the servers at ``urls`` (their WebSocket or HTTP URLs),
    summed: behind a balancer, every replica's."""
    total: dict[str, float] = {}
    for url in urls:
        http = url.replace("ws://", "http://").replace("wss://", "https://")
        text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split()[:2]
                total[name] = total.get(name, 0.0) + float(value)
    return total


def drive(url: str, drafter: Any, fingerprint: Fingerprint, prompt: list[int], k: int,
          max_tokens: int, cloud_only: bool, window: Window, offset: float, seed: int,
          stream: bool = False, temperature: float = 0.0, source: str = "model"
          ) -> ClientResult:
    """One edge session generating, again and again, from ``offset`` seconds after the
    ``window``'s start until it closes: greedily, or sampled at ``temperature`` (verified
    by match, as stream drafting verifies), drafting with ``drafter`` (``source`` "model")
    or without a model (``source`` "lookup" or "suffix", ``drafter`` None)."""
    from spececd.edge.client import EdgeClient
    from spececd.edge.options import DraftKind, EdgeOptions, Proactive, Resolved
    from spececd.transports.registry import connector

    client = EdgeClient(drafter, connector(url), fingerprint, 1 << 30)
    # Plain rounds, as the load figures are defined (a verify pass per round), or stream
    # drafting; not the default "auto", which chooses between them. No stop tokens: every
    # generation runs to max_tokens.
    run = Resolved(EdgeOptions(mode=Mode.MATCH if temperature else Mode.GREEDY, k=k,
                               proactive=Proactive.STREAM if stream else Proactive.OFF,
                               draft_source=DraftKind(source)),
                   SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens))
    result = ClientResult()
    window.ready()
    window.wait_start(offset)
    try:
        while time.monotonic() < window.closes:
            stats = GenerationStats()
            last, first = time.monotonic(), True
            for out in client.generate(prompt, run, stats, cloud_only):
                now = time.monotonic()
                if not result.events:
                    window.join()
                result.record(now, now - last, len(out.token_ids), first)
                last, first = now, False
                if now >= window.closes:
                    break
            result.drafted += stats.drafted
            result.accepted += stats.accepted
    finally:
        client.close()
    return result


def drive_openai(url: str, model: str, prompt: list[int], max_tokens: int,
                 window: Window, offset: float, temperature: float = 0.0) -> ClientResult:
    """One client of an OpenAI-compatible server (vLLM's) completing, again and again, from
    ``offset`` seconds after the ``window``'s start until it closes (greedily, or sampled at
    ``temperature``). Completions are not streamed: each is one round, and none is a first
    token."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    result = ClientResult()
    window.ready()
    window.wait_start(offset)
    while time.monotonic() < window.closes:
        last = time.monotonic()
        done = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                         temperature=temperature,
                                         extra_body={"ignore_eos": True})
        if not result.events:
            window.join()
        now = time.monotonic()
        result.record(now, now - last, done.usage.completion_tokens if done.usage else 0,
                      False)
    return result


def engine_steps(counters: dict[str, float]) -> float:
    """Target forward passes so far: vLLM's iterations (summed over its labels) where the
    server runs vLLM, else the built-in engine's batches."""
    vllm = [value for key, value in counters.items()
            if key.startswith("vllm:iteration_tokens_total_count")]
    return sum(vllm) if vllm else counters.get("spececd_batch_size_count", 0.0)


_window: Window | None = None  # a draft process's (set as the pool starts it)


def _enter(window: Window) -> None:
    global _window
    _window = window
    end_with_parent()  # a client process ends with the bench, SIGKILL included


def _draft_process(url: str, draft_model: str, prompt: list[int], k: int, max_tokens: int,
                   offset: float, seed: int, stream: bool = False,
                   temperature: float = 0.0, device: str = "cpu") -> ClientResult:
    import torch
    from transformers.utils import logging as hf_logging

    from spececd.backends.registry import load_backend
    from spececd.edge.drafter import Drafter

    assert _window is not None
    try:
        torch.set_num_threads(1)
        hf_logging.disable_progress_bar()
        backend = load_backend(draft_model, device=device, dtype="auto")
        fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
        return drive(url, Drafter(backend), fingerprint, prompt, k, max_tokens, False,
                     _window, offset, seed, stream, temperature)
    except BaseException:
        _window.leave()
        raise


def target_traces(url: str, fingerprint: Fingerprint, prompts: list[list[int]],
                  length: int, clients: int, temperature: float = 0.0) -> list[list[int]]:
    """Client ``i``'s continuation of its prompt (``prompts[i % len(prompts)]``) as the
    server generates it alone: greedy, or sampled at ``temperature`` with seed ``i`` (the
    client's, :func:`drive`)."""
    from spececd.edge.client import EdgeClient
    from spececd.edge.options import EdgeOptions, Resolved
    from spececd.transports.registry import connector

    client = EdgeClient(ReplayDrafter([], [], 1.0, 2, 0), connector(url),
                        fingerprint, 1 << 30)
    traces: list[list[int]] = []
    done: dict[tuple[int, int], list[int]] = {}  # greedy: one per prompt
    for i in range(clients):
        key = (i % len(prompts), i if temperature else 0)
        if key not in done:
            run = Resolved(EdgeOptions(), SamplingParams(temperature=temperature, seed=i,
                                                         max_tokens=length))
            done[key] = [t for out in client.generate(prompts[key[0]], run,
                                                      GenerationStats(), cloud_only=True)
                         for t in out.token_ids]
        traces.append(done[key])
    client.close()
    return traces


def run_load(url: str, fingerprint: Fingerprint, prompts: list[list[int]], clients: int,
             duration: float, kind: str, acceptance: float = 0.8, k: int = 4,
             max_tokens: int = 64, draft_model: str | None = None,
             traces: list[list[int]] | None = None,
             replicas: Sequence[str] = (), model: str = "",
             temperature: float = 0.0, draft_device: str = "cpu",
             warmup_s: float = WARMUP_S, ramp_s: float = 0.0) -> dict[str, Any]:
    """Run ``clients`` sessions of ``kind`` (``replay``, ``draft``, ``lookup``, ``suffix``,
    ``cloud-only``, or ``vllm-spec``: clients of the OpenAI server at ``url`` serving
    ``model``; ``-stream``: stream drafting), client ``i`` starting ``i * ramp_s /
    clients`` seconds in (0: all at once); measure a window of ``duration`` seconds that
    opens ``warmup_s`` after every client has had its first token (:class:`Window`), and
    return its figures. ``replicas``: where the server metrics are read when ``url`` is a
    balancer (default: ``url`` itself); draft clients run their model on
    ``draft_device``."""
    if kind.startswith("replay") and traces is None:
        traces = target_traces(url, fingerprint, prompts, max_tokens, clients, temperature)
    window = Window()
    source = kind.removesuffix("-stream") if kind.startswith(("lookup", "suffix")) \
        else "model"

    def client(i: int) -> ClientResult:
        prompt, offset = prompts[i % len(prompts)], i * ramp_s / clients
        if kind == "vllm-spec":
            return drive_openai(url, model, prompt, max_tokens, window, offset, temperature)
        drafter = (ReplayDrafter(prompt, traces[i], acceptance, fingerprint.vocab_size,
                                 seed=i) if kind.startswith("replay") and traces else None)
        return drive(url, drafter, fingerprint, prompt, k, max_tokens, kind == "cloud-only",
                     window, offset, i, kind.endswith("-stream"), temperature, source)

    with contextlib.ExitStack() as stack:
        if kind.startswith("draft"):
            assert draft_model is not None
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
                clients, initializer=_enter, initargs=(window,)))
            pending = pool.starmap_async(_draft_process, [
                (url, draft_model, prompts[i % len(prompts)], k, max_tokens,
                 i * ramp_s / clients, i, kind == "draft-stream", temperature, draft_device)
                for i in range(clients)], chunksize=1)

            def finished() -> bool:
                return pending.ready()

            def collect() -> list[ClientResult]:
                return pending.get()
        else:
            results = [ClientResult() for _ in range(clients)]

            def run(i: int) -> None:
                try:
                    results[i] = client(i)
                except Exception:
                    log.exception("client %d of %d (%s) failed", i, clients, kind)
                    window.leave()

            # daemons: clients blocked on a server that hangs must not keep the bench alive
            threads = [threading.Thread(target=run, args=(i,), daemon=True)
                       for i in range(clients)]
            for thread in threads:
                thread.start()

            def finished() -> bool:
                return not any(thread.is_alive() for thread in threads)

            def collect() -> list[ClientResult]:
                for thread in threads:
                    thread.join()
                return results

        while sum(window.counts[::2]) < clients and not finished():  # draft models loading
            time.sleep(0.05)
        started = window.start()
        while sum(window.counts[1:]) < clients and not finished():
            time.sleep(0.05)
        joined, join_s = window.counts[1], time.monotonic() - started
        opened = time.monotonic() + warmup_s
        window.close_at(opened + duration)
        time.sleep(max(0.0, opened - time.monotonic()))
        before = metrics(*(replicas or [url]))
        time.sleep(max(0.0, opened + duration - time.monotonic()))
        after = metrics(*(replicas or [url]))
        results = collect()
    figures = window_figures(results, opened, opened + duration, max_tokens, joined)
    drafted = sum(r.drafted for r in results)
    passes = engine_steps(after) - engine_steps(before)
    batched = after.get("spececd_batch_size_sum", 0) - before.get("spececd_batch_size_sum", 0)
    batches = (after.get("spececd_batch_size_count", 0)  # the built-in engine's passes
               - before.get("spececd_batch_size_count", 0))
    buckets = {key.split('"')[1]: int(after[key] - before.get(key, 0)) for key in after
               if key.startswith("spececd_batch_size_bucket")}
    tokens = figures["tokens"]
    row = {
        "clients": clients, "kind": kind,
        "acceptance_target": acceptance if kind.startswith("replay") else None,
        "temperature": temperature,
        "arrival": "stagger" if ramp_s else "all", "ramp_s": ramp_s,
        "warmup_s": warmup_s, "join_s": round(join_s, 2),
        # what the verifier accepted of the clients' drafts over the whole run (vllm-spec:
        # not seen here)
        "acceptance": round(sum(r.accepted for r in results) / drafted, 4) if drafted else None,
        "duration_s": duration,
        **figures,
        "forward_passes": int(passes),
        "passes_per_token": round(passes / tokens, 4) if tokens else None,
        "mean_batch": round(batched / batches, 2) if batches else None,  # vLLM: none
        "batch_size_buckets": buckets,  # cumulative counts, Prometheus style
    }
    if not row["steady"]:
        log.warning("%d %s clients, arrival %s: the window was not steady (%s): lengthen "
                    "--duration or --warmup-s", clients, kind_label(row), arrival_label(row),
                    row["steady_note"])
    return row


def run_curve(servers: Sequence[tuple[str, dict[str, Any]]], fingerprint: Fingerprint,
              prompts: list[list[int]], clients: list[int], duration: float,
              kinds: list[str], acceptance: float | Sequence[float], k: int, max_tokens: int,
              draft_model: str | None, progress: Any = None, replicas: Sequence[str] = (),
              model: str = "", temperature: float = 0.0, stall_s: float = STALL_S,
              draft_device: str = "cpu", warmup_s: float = WARMUP_S,
              arrivals: Sequence[str] = ("all",), ramp_s: float = RAMP_S
              ) -> list[dict[str, Any]]:
    """For each N in ``clients``, each kind in turn (replay kinds once for each of
    ``acceptance``), each of ``arrivals`` (``all`` at once, or ``stagger``-ed over
    ``ramp_s``), a row on each of ``servers`` in turn (interleaved: (URL, what to add to its
    rows)). ``model``: the model name an OpenAI server (``vllm-spec``) serves. A row that
    has not finished ``stall_s`` after its schedule stops the curve
    (:class:`~spececd.bench.child.Stalled`)."""
    acceptances = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
    traces = (within("the replay clients' traces (the server generating alone)", stall_s,
                     target_traces, servers[0][0], fingerprint, prompts, max_tokens,
                     max(clients), temperature)
              if any(kind.startswith("replay") for kind in kinds) else None)
    rows = []
    for n in clients:
        for kind in kinds:
            for rate in acceptances if kind.startswith("replay") else acceptances[:1]:
                for arrival in arrivals:
                    ramp = ramp_s if arrival == "stagger" else 0.0
                    for url, tags in servers:
                        rows.append({**within(
                            f"the run of {n} {kind} clients", ramp + warmup_s + duration
                            + stall_s, functools.partial(
                                run_load, url, fingerprint, prompts, n, duration, kind, rate,
                                k, max_tokens, draft_model, traces, replicas, model,
                                temperature, draft_device, warmup_s=warmup_s, ramp_s=ramp)),
                            **tags})
                        if progress is not None:
                            progress(rows[-1])
    return rows
