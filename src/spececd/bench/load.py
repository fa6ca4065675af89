"""`spececd bench load`: N concurrent edge sessions against one verifier server.

Client kinds, labelled in every report:

- ``replay``: clients that run no model. Each knows the target's greedy continuation of its
  prompt (asked once from the server, cloud-only) and proposes it, replacing each token by
  a wrong one with probability ``1 - acceptance``: greedy verification then accepts each
  position with that probability. Drafting costs nothing, so the server alone bounds the
  load (a capacity run).
- ``draft``: real drafters, a pool of processes each running the draft model.

The baseline is the same server generating for the same N users by itself (cloud-only
generation; its decode steps are batched across users by the same scheduler).

Reported: server tokens/s, per-client tokens/s, round latency percentiles, the batch-size
distribution and target forward passes per generated token (both from the server's
Prometheus metrics, as differences over the run).
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spececd.backends.base import tokenizer_fingerprint
from spececd.core.sampling import Mode, SamplingParams, SparseProbs
from spececd.core.stats import GenerationStats
from spececd.protocol.messages import Fingerprint


class ReplayDrafter:
    """Proposes the target's own greedy continuation, corrupted position by position."""

    def __init__(self, prompt: Sequence[int], trace: Sequence[int], acceptance: float,
                 vocab: int, seed: int) -> None:
        self.prompt, self.trace = list(prompt), list(trace)
        self.acceptance, self.vocab = acceptance, vocab
        self.rng = random.Random(seed)

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
    seconds: float = 0.0  # time spent generating (model loading excluded)


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
          max_tokens: int, cloud_only: bool, deadline: float, seed: int) -> ClientResult:
    """One edge session generating greedily, again and again, until ``deadline``."""
    from spececd.edge.client import EdgeClient
    from spececd.edge.options import EdgeOptions, Proactive
    from spececd.transports.registry import connector

    # Plain rounds, as the load figures are defined (a verify pass per round), not the
    # default "auto", which may stream.
    client = EdgeClient(drafter, connector(url), fingerprint, 1 << 30,
                        options=EdgeOptions(mode=Mode.GREEDY, k=k, proactive=Proactive.OFF))
    result = ClientResult()
    params = SamplingParams(temperature=0.0, seed=seed, max_tokens=max_tokens)
    start = time.perf_counter()
    try:
        while time.perf_counter() < deadline:
            stats = GenerationStats()
            last = time.perf_counter()
            for out in client.generate(prompt, params, stats, cloud_only):
                now = time.perf_counter()
                result.latencies.append(now - last)
                result.tokens += len(out.token_ids)
                last = now
                if now >= deadline:
                    break
    finally:
        client.close()
    result.seconds = time.perf_counter() - start
    return result


def _draft_process(url: str, draft_model: str, prompt: list[int], k: int, max_tokens: int,
                   seconds: float, seed: int) -> ClientResult:
    import torch
    from transformers.utils import logging as hf_logging

    from spececd.backends.registry import load_backend
    from spececd.edge.drafter import Drafter

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    backend = load_backend(draft_model, device="cpu", dtype="float32")
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    return drive(url, Drafter(backend), fingerprint, prompt, k, max_tokens, False,
                 time.perf_counter() + seconds, seed)


def target_traces(url: str, fingerprint: Fingerprint, prompts: list[list[int]],
                  length: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt, generated by the server itself."""
    from spececd.edge.client import EdgeClient
    from spececd.transports.registry import connector

    client = EdgeClient(ReplayDrafter([], [], 1.0, 2, 0), connector(url),
                        fingerprint, 1 << 30)
    traces = []
    for prompt in prompts:
        params = SamplingParams(temperature=0.0, seed=0, max_tokens=length)
        traces.append([t for out in client.generate(prompt, params, GenerationStats(),
                                                    cloud_only=True)
                       for t in out.token_ids])
    client.close()
    return traces


def run_load(url: str, fingerprint: Fingerprint, prompts: list[list[int]], clients: int,
             duration: float, kind: str, acceptance: float = 0.8, k: int = 4,
             max_tokens: int = 64, draft_model: str | None = None,
             traces: list[list[int]] | None = None,
             replicas: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``clients`` sessions of ``kind`` (``replay``, ``draft`` or ``cloud-only``) for
    ``duration`` seconds; return the measured figures. ``replicas``: where the server
    metrics are read when ``url`` is a balancer (default: ``url`` itself)."""
    if kind == "replay" and traces is None:
        traces = target_traces(url, fingerprint, prompts, max_tokens)
    before = metrics(*(replicas or [url]))
    start = time.perf_counter()
    deadline = start + duration
    if kind == "draft":
        assert draft_model is not None
        with multiprocessing.get_context("spawn").Pool(clients) as pool:
            results = pool.starmap(_draft_process, [
                (url, draft_model, prompts[i % len(prompts)], k, max_tokens, duration, i)
                for i in range(clients)])
    else:
        results = [ClientResult() for _ in range(clients)]

        def run(i: int) -> None:
            prompt = prompts[i % len(prompts)]
            drafter = (ReplayDrafter(prompt, traces[i % len(prompts)], acceptance,
                                     fingerprint.vocab_size, seed=i) if traces else None)
            results[i] = drive(url, drafter, fingerprint, prompt, k, max_tokens,
                               kind == "cloud-only", deadline, i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    # Clients generate for ``duration`` each; draft processes start after loading their
    # model, so the window is the longest a client spent generating, not the wall time.
    wall = max(r.seconds for r in results) or (time.perf_counter() - start)
    after = metrics(*(replicas or [url]))
    tokens = sum(r.tokens for r in results)
    latencies = sorted(x for r in results for x in r.latencies)
    passes = after.get("spececd_batch_size_count", 0) - before.get("spececd_batch_size_count", 0)
    batched = after.get("spececd_batch_size_sum", 0) - before.get("spececd_batch_size_sum", 0)
    buckets = {key.split('"')[1]: int(after[key] - before.get(key, 0)) for key in after
               if key.startswith("spececd_batch_size_bucket")}

    def percentile(q: float) -> float:
        if not latencies:
            return 0.0
        return round(1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2)

    return {
        "clients": clients, "kind": kind,
        "acceptance_target": acceptance if kind == "replay" else None,
        "duration_s": round(wall, 2),
        "server_tokens_per_s": round(tokens / wall, 2),
        "client_tokens_per_s": round(statistics.median(r.tokens / wall for r in results), 2),
        "round_latency_ms": {"p50": percentile(0.5), "p95": percentile(0.95),
                             "p99": percentile(0.99)},
        "forward_passes": int(passes),
        "passes_per_token": round(passes / tokens, 4) if tokens else None,
        "mean_batch": round(batched / passes, 2) if passes else None,
        "batch_size_buckets": buckets,  # cumulative counts, Prometheus style
        "tokens": tokens,
    }


def run_curve(url: str, fingerprint: Fingerprint, prompts: list[list[int]],
              clients: list[int], duration: float, kinds: list[str], acceptance: float,
              k: int, max_tokens: int, draft_model: str | None,
              progress: Any = None, replicas: Sequence[str] = ()) -> list[dict[str, Any]]:
    """For each N in ``clients``, each kind in turn; the cloud-only baseline beside them."""
    traces = (target_traces(url, fingerprint, prompts, max_tokens)
              if "replay" in kinds else None)
    rows = []
    for n in clients:
        for kind in kinds:
            rows.append(run_load(url, fingerprint, prompts, n, duration, kind, acceptance, k,
                                 max_tokens, draft_model, traces, replicas))
            if progress is not None:
                progress(rows[-1])
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| clients | kind | server tokens/s | per client | × cloud-only | p50 / p95 / p99 "
             "round ms | passes/token | mean batch |", "|---|---|---|---|---|---|---|---|"]
    baseline = {r["clients"]: r["server_tokens_per_s"] for r in rows if r["kind"] == "cloud-only"}
    for r in rows:
        lat = r["round_latency_ms"]
        ratio = (f"{r['server_tokens_per_s'] / baseline[r['clients']]:.2f}"
                 if baseline.get(r["clients"]) and r["kind"] != "cloud-only" else "–")
        label = r["kind"] + (f" (acceptance {r['acceptance_target']})"
                             if r["acceptance_target"] is not None else "")
        lines.append(f"| {r['clients']} | {label} | {r['server_tokens_per_s']} | "
                     f"{r['client_tokens_per_s']} | {ratio} | {lat['p50']} / {lat['p95']} / "
                     f"{lat['p99']} | {r['passes_per_token']} | {r['mean_batch']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in dict.fromkeys(r["kind"] for r in rows):
        points = sorted((r["clients"], r["server_tokens_per_s"]) for r in rows
                        if r["kind"] == kind)
        ax.plot(*zip(*points, strict=True), marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("server tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
