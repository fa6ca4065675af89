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

Reported: server tokens/s, per-client tokens/s, round latency and per-token latency
percentiles, the batch-size distribution and target forward passes (engine steps) per
generated token (from the server's Prometheus metrics, as differences over the run: the
built-in engine's batch histogram, or vLLM's ``vllm:iteration_tokens_total``).

A curve (:func:`run_curve`) runs every kind at every number of clients, replay clients
at each acceptance asked for; each row, and the replay clients' traces before them, has
the stall limit of :mod:`spececd.bench.child` on top of its duration.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spececd.backends.base import tokenizer_fingerprint
from spececd.bench.child import STALL_S, within
from spececd.core.params import Mode, SamplingParams
from spececd.core.sampling import SparseProbs
from spececd.core.stats import GenerationStats
from spececd.protocol.messages import Fingerprint


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


@dataclass
class ClientResult:
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds per round (per token
    # for cloud-only)
    token_latencies: list[float] = field(default_factory=list)  # a round's seconds over
    # its tokens, once for each of them
    seconds: float = 0.0  # time spent generating (model loading excluded)
    drafted: int = 0  # drafted tokens verified, and accepted, over the client's generations
    accepted: int = 0

    def record(self, seconds: float, tokens: int) -> None:
        self.latencies.append(seconds)
        self.tokens += tokens
        self.token_latencies.extend([seconds / tokens] * tokens if tokens else [])


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
          max_tokens: int, cloud_only: bool, deadline: float, seed: int,
          stream: bool = False, temperature: float = 0.0, source: str = "model"
          ) -> ClientResult:
    """One edge session generating, again and again, until ``deadline``: greedily, or
    sampled at ``temperature`` (verified by match, as stream drafting verifies), drafting
    with ``drafter`` (``source`` "model") or without a model (``source`` "lookup" or
    "suffix", ``drafter`` None)."""
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
    start = time.perf_counter()
    try:
        while time.perf_counter() < deadline:
            stats = GenerationStats()
            last = time.perf_counter()
            for out in client.generate(prompt, run, stats, cloud_only):
                now = time.perf_counter()
                result.record(now - last, len(out.token_ids))
                last = now
                if now >= deadline:
                    break
            result.drafted += stats.drafted
            result.accepted += stats.accepted
    finally:
        client.close()
    result.seconds = time.perf_counter() - start
    return result


def drive_openai(url: str, model: str, prompt: list[int], max_tokens: int,
                 deadline: float, temperature: float = 0.0) -> ClientResult:
    """One client of an OpenAI-compatible server (vLLM's) completing, again and again,
    until ``deadline`` (greedily, or sampled at ``temperature``)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    result = ClientResult()
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        last = time.perf_counter()
        done = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                         temperature=temperature,
                                         extra_body={"ignore_eos": True})
        result.record(time.perf_counter() - last,
                      done.usage.completion_tokens if done.usage else 0)
    result.seconds = time.perf_counter() - start
    return result


def engine_steps(counters: dict[str, float]) -> float:
    """Target forward passes so far: vLLM's iterations (summed over its labels) where the
    server runs vLLM, else the built-in engine's batches."""
    vllm = [value for key, value in counters.items()
            if key.startswith("vllm:iteration_tokens_total_count")]
    return sum(vllm) if vllm else counters.get("spececd_batch_size_count", 0.0)


def _draft_process(url: str, draft_model: str, prompt: list[int], k: int, max_tokens: int,
                   seconds: float, seed: int, stream: bool = False,
                   temperature: float = 0.0, device: str = "cpu") -> ClientResult:
    import torch
    from transformers.utils import logging as hf_logging

    from spececd.backends.registry import load_backend
    from spececd.edge.drafter import Drafter

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    backend = load_backend(draft_model, device=device, dtype="auto")
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    return drive(url, Drafter(backend), fingerprint, prompt, k, max_tokens, False,
                 time.perf_counter() + seconds, seed, stream, temperature)


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
             temperature: float = 0.0, draft_device: str = "cpu") -> dict[str, Any]:
    """Run ``clients`` sessions of ``kind`` (``replay``, ``draft``, ``lookup``, ``suffix``,
    ``cloud-only``, or ``vllm-spec``: clients of the OpenAI server at ``url`` serving
    ``model``; ``-stream``: stream drafting) for
    ``duration`` seconds; return the measured figures. ``replicas``: where the server
    metrics are read when ``url`` is a balancer (default: ``url`` itself); draft clients
    run their model on ``draft_device``."""
    if kind.startswith("replay") and traces is None:
        traces = target_traces(url, fingerprint, prompts, max_tokens, clients, temperature)
    before = metrics(*(replicas or [url]))
    start = time.perf_counter()
    deadline = start + duration
    if kind == "vllm-spec":
        with multiprocessing.pool.ThreadPool(clients) as openai_clients:
            results = openai_clients.starmap(drive_openai, [
                (url, model, prompts[i % len(prompts)], max_tokens, deadline, temperature)
                for i in range(clients)])
    elif kind.startswith("draft"):
        assert draft_model is not None
        with multiprocessing.get_context("spawn").Pool(clients) as pool:
            results = pool.starmap(_draft_process, [
                (url, draft_model, prompts[i % len(prompts)], k, max_tokens, duration, i,
                 kind == "draft-stream", temperature, draft_device)
                for i in range(clients)])
    else:
        results = [ClientResult() for _ in range(clients)]

        source = kind.removesuffix("-stream") if kind.startswith(("lookup", "suffix")) \
            else "model"

        def run(i: int) -> None:
            prompt = prompts[i % len(prompts)]
            drafter = (ReplayDrafter(prompt, traces[i], acceptance,
                                     fingerprint.vocab_size, seed=i) if traces else None)
            results[i] = drive(url, drafter, fingerprint, prompt, k, max_tokens,
                               kind == "cloud-only", deadline, i, kind.endswith("-stream"),
                               temperature, source)

        # daemons: clients blocked on a server that hangs must not keep the bench alive
        threads = [threading.Thread(target=run, args=(i,), daemon=True)
                   for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    # Clients generate for ``duration`` each; draft processes start after loading their
    # model, so the window is the longest a client spent generating, not the wall time.
    wall = max(r.seconds for r in results) or (time.perf_counter() - start)
    after = metrics(*(replicas or [url]))
    tokens = sum(r.tokens for r in results)
    drafted = sum(r.drafted for r in results)
    latencies = sorted(x for r in results for x in r.latencies)
    token_latencies = sorted(x for r in results for x in r.token_latencies)
    passes = engine_steps(after) - engine_steps(before)
    batched = after.get("spececd_batch_size_sum", 0) - before.get("spececd_batch_size_sum", 0)
    batches = (after.get("spececd_batch_size_count", 0)  # the built-in engine's passes
               - before.get("spececd_batch_size_count", 0))
    buckets = {key.split('"')[1]: int(after[key] - before.get(key, 0)) for key in after
               if key.startswith("spececd_batch_size_bucket")}

    def percentile(q: float, values: list[float] = latencies) -> float:
        if not values:
            return 0.0
        return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 2)

    return {
        "clients": clients, "kind": kind,
        "acceptance_target": acceptance if kind.startswith("replay") else None,
        "temperature": temperature,
        # what the verifier accepted of the clients' drafts (vllm-spec: not seen here)
        "acceptance": round(sum(r.accepted for r in results) / drafted, 4) if drafted else None,
        "duration_s": round(wall, 2),
        "server_tokens_per_s": round(tokens / wall, 2),
        "client_tokens_per_s": round(statistics.median(r.tokens / wall for r in results), 2),
        "round_latency_ms": {"p50": percentile(0.5), "p95": percentile(0.95),
                             "p99": percentile(0.99)},
        "token_latency_ms": {"p50": percentile(0.5, token_latencies),
                             "p95": percentile(0.95, token_latencies)},
        "forward_passes": int(passes),
        "passes_per_token": round(passes / tokens, 4) if tokens else None,
        "mean_batch": round(batched / batches, 2) if batches else None,  # vLLM: none
        "batch_size_buckets": buckets,  # cumulative counts, Prometheus style
        "tokens": tokens,
    }


def run_curve(url: str, fingerprint: Fingerprint, prompts: list[list[int]],
              clients: list[int], duration: float, kinds: list[str],
              acceptance: float | Sequence[float], k: int, max_tokens: int,
              draft_model: str | None, progress: Any = None, replicas: Sequence[str] = (),
              model: str = "", temperature: float = 0.0, stall_s: float = STALL_S,
              draft_device: str = "cpu") -> list[dict[str, Any]]:
    """For each N in ``clients``, each kind in turn (replay kinds once for each of
    ``acceptance``); the cloud-only baseline beside them. ``model``: the model name an
    OpenAI server (``vllm-spec``) serves. A row that has not finished ``stall_s`` after
    its duration stops the curve (:class:`~spececd.bench.child.Stalled`)."""
    acceptances = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
    traces = (within("the replay clients' traces (the server generating alone)", stall_s,
                     target_traces, url, fingerprint, prompts, max_tokens, max(clients),
                     temperature)
              if any(kind.startswith("replay") for kind in kinds) else None)
    rows = []
    for n in clients:
        for kind in kinds:
            for rate in acceptances if kind.startswith("replay") else acceptances[:1]:
                rows.append(within(
                    f"the run of {n} {kind} clients", duration + stall_s, run_load, url,
                    fingerprint, prompts, n, duration, kind, rate, k, max_tokens,
                    draft_model, traces, replicas, model, temperature, draft_device))
                if progress is not None:
                    progress(rows[-1])
    return rows


def _engine(row: dict[str, Any]) -> str:
    """The engine a row's server ran (rows of older runs name none: the built-in one)."""
    return str(row.get("engine", "builtin"))


def kind_label(row: dict[str, Any]) -> str:
    """A row's kind, with the acceptance replayed at and the temperature where they apply."""
    label = str(row["kind"]) + (f" (replaying at {row['acceptance_target']})"
                                if row.get("acceptance_target") is not None else "")
    if row.get("temperature"):
        label += f", temperature {row['temperature']:g}"
    return label


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row; each row's ratio is against cloud-only on the same engine."""
    lines = ["| clients | engine | kind | server tokens/s | per client | × cloud-only | "
             "acceptance | p50 / p95 / p99 round ms | p50 / p95 ms per token | passes/token | "
             "mean batch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    baseline = {(_engine(r), r["clients"]): r["server_tokens_per_s"] for r in rows
                if r["kind"] == "cloud-only"}
    for r in rows:
        lat, per_token = r["round_latency_ms"], r.get("token_latency_ms", {})
        base = baseline.get((_engine(r), r["clients"]))
        ratio = (f"{r['server_tokens_per_s'] / base:.2f}"
                 if base and r["kind"] != "cloud-only" else "–")
        lines.append(f"| {r['clients']} | {_engine(r)} | {kind_label(r)} | "
                     f"{r['server_tokens_per_s']} | {r['client_tokens_per_s']} | {ratio} | "
                     f"{r.get('acceptance') if r.get('acceptance') is not None else '–'} | "
                     f"{lat['p50']} / {lat['p95']} / {lat['p99']} | "
                     f"{per_token.get('p50', '–')} / {per_token.get('p95', '–')} | "
                     f"{r['passes_per_token']} | {r['mean_batch']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    engines = {_engine(r) for r in rows}
    for line in dict.fromkeys((_engine(r), kind_label(r)) for r in rows):
        points = sorted((r["clients"], r["server_tokens_per_s"]) for r in rows
                        if (_engine(r), kind_label(r)) == line)
        name = line[1] if len(engines) == 1 else f"{line[1]} [{line[0]}]"
        ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("server tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
