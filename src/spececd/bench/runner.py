"""`spececd bench`: every configuration side by side, in one run, alternating order.

Processes: the verifier server (``spececd serve``, one torch thread), one delay proxy per
RTT in front of it (:mod:`spececd.bench.netem`, run in this process), and three workers
(:mod:`spececd.bench.worker`, one torch thread each): the target alone, transformers'
assisted generation, and the SpecECD edge (which also runs the cloud-only passes).
Each pass runs one configuration over all prompts; passes alternate their order
(forward, then reversed) so that drift on the machine hits every configuration alike.
The first pass of each configuration is a warm-up on two prompts and is not counted.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from spececd.backends.registry import model_format
from spececd.bench.load import metrics
from spececd.bench.netem import DelayProxy
from spececd.bench.report import SCHEMA_TAG, UNCONSTRAINED_TAG
from spececd.edge.options import EdgeOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    draft: str
    target: str
    prompts: list[str]
    rtt_ms: list[float] = field(default_factory=lambda: [0.0, 20.0, 50.0])
    ks: list[int | str] = field(default_factory=lambda: ["auto"])  # ints or "auto"
    proactive: list[str] = field(default_factory=lambda: ["off", "on", "stream", "auto"])
    iterations: int = 3
    max_tokens: int = 64
    temperature: float = 0.0  # greedy: the output is the target's own, checkable
    mode: str = EdgeOptions().mode.value
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    jitter_ms: float = 0.0
    baselines: bool = True  # run the target alone and transformers' assisted generation
    drafts: list[str] = field(default_factory=list)  # several drafts side by side ([] = draft)
    targets: list[str] = field(default_factory=list)  # several targets ([] = target)
    max_batch: int = 32  # the server's sessions per forward pass
    transports: list[str] = field(default_factory=lambda: ["websocket"])  # edge-cloud links
    trees: list[int] = field(default_factory=lambda: [1])  # tree widths (1: chains)
    # Where drafts come from (DraftKind values; "auto": the edge's default)
    sources: list[str] = field(default_factory=lambda: ["auto"])
    engine: str = "builtin"  # the server's engine: builtin or vllm
    # A JSON schema (its text): rows of constrained generation beside the others (the
    # target alone, cloud-only, and SpecECD drafting under it and unconstrained)
    json_schema: str | None = None


def config_name(kind: str, rtt: float | None = None, k: int | str | None = None,
                proactive: str | None = None, tree: int | None = None,
                source: str | None = None) -> str:
    name = {"target": "target alone", "alone": "target alone", "assisted": "HF assisted",
            "cloud": "cloud-only",
            "spececd": "SpecECD", "bare": "target's bare forward",
            "llama_alone": "llama.cpp target alone",
            "llama_lookup": "llama.cpp prompt-lookup speculative",
            "llama_speculative": "llama.cpp speculative (draft model, in-process)"}[kind]
    if k is not None:
        name += f" k={k}"
    if proactive is not None:
        name += {"off": " plain", "on": " proactive", "stream": " stream",
                 "auto": " auto"}[proactive]
    if tree:
        name += f" tree {tree}"
    if source:
        name += f", {source} drafts"
    if rtt is not None:
        name += f" @ RTT {rtt:g} ms"
    return name


class Worker:
    def __init__(self, job: dict[str, Any]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "spececd.bench.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self._send(job)
        assert self._read().get("ready")

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited with {self.proc.wait()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        self._send(request)
        return self._read()["results"]  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


# One core for the server, whichever its engine: the built-in one runs one torch thread,
# vLLM's CPU build one OpenMP thread bound to core 0 (and 2 GiB of KV cache).
SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
              "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}


def start_server(cfg: BenchConfig, transports: tuple[str, ...] = ("websocket",)
                 ) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """``spececd serve`` for ``cfg.target`` with a listener for each of ``transports``; the
    process and each transport's port. Its stderr is drained by a thread once it runs."""
    ports = {"websocket": "--port", "grpc": "--grpc-port", "http": "--http-port"}
    listen = [arg for name in ("websocket", "grpc", "http")
              for arg in (ports[name], str(cfg.port) if name in transports else "-1")]
    # vLLM: 16 draft slots per step at most (vLLM reserves them per request)
    engine = ["--engine", "vllm", "--max-draft", "16"] if cfg.engine == "vllm" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "spececd", "serve", "--target-model", cfg.target, "--host",
         cfg.host, *listen, "--device", cfg.device, "--threads", "1",
         "--dtype", "float32", "--max-batch", str(cfg.max_batch), "--max-sessions", "256",
         *engine],
        stderr=subprocess.PIPE, text=True, env={**os.environ, **SERVER_ENV})
    assert proc.stderr is not None
    for line in proc.stderr:
        if "serving" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr or []],  # drain
                             daemon=True).start()
            schemes = {"ws": "websocket", "grpc": "grpc", "http": "http"}
            return proc, {schemes[scheme]: int(port) for scheme, port
                          in re.findall(r"(\w+)://[\w.]+:(\d+)", line)}
    raise RuntimeError(f"the verifier server did not start: exit {proc.wait()}")


def start_openai_server(target: str, draft: str, k: int, max_batch: int,
                        timeout: float = 600.0) -> tuple[subprocess.Popen[str], str]:
    """vLLM's own OpenAI server for ``target``, speculating with ``draft`` in-process (the
    ``draft_model`` method, ``k`` tokens): the process and its URL, once it answers."""
    import socket
    import urllib.request

    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
         "--served-model-name", target, "--dtype", "float32", "--host", "127.0.0.1",
         "--port", str(port), "--max-num-seqs", str(max_batch),
         "--speculative-config", json.dumps(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **SERVER_ENV})
    threading.Thread(target=lambda: [None for _ in proc.stderr or []], daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's OpenAI server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise RuntimeError("vLLM's OpenAI server did not start in time")


def machine() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads_per_process": 1}


def name(entry: dict[str, Any]) -> str:
    return config_name(entry["kind"], entry.get("rtt_ms"), entry.get("k"),
                       entry.get("proactive"), entry.get("tree"),
                       entry.get("draft_source")) + entry.get("tag", "")


def label(model: str) -> str:
    path = Path(model)
    return path.name if path.suffix == ".gguf" else path.name or model


def llama_speculative_binary() -> str | None:
    """llama.cpp's ``llama-speculative-simple`` where
    ``scripts/build-llama-speculative.sh`` put it ($SPECECD_LLAMA_SPECULATIVE, or
    ~/.cache/spececd/), if it is there."""
    path = Path(os.environ.get("SPECECD_LLAMA_SPECULATIVE")
                or Path.home() / ".cache" / "spececd" / "llama-speculative-simple")
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run every configuration and return the raw results (see report.summarise).

    With several drafts or targets (``cfg.drafts``, ``cfg.targets``), every pair runs in
    the same passes: one server per target, one edge worker per draft. The target-alone and
    assisted baselines run for transformers models only."""
    drafts, targets = cfg.drafts or [cfg.draft], cfg.targets or [cfg.target]
    pairs = len(drafts) > 1 or len(targets) > 1
    servers: list[subprocess.Popen[str]] = []
    proxies: dict[tuple[int, float, str], DelayProxy] = {}
    workers: dict[str, Worker] = {}
    common = dict(prompts=cfg.prompts, seed=cfg.seed, max_tokens=cfg.max_tokens,
                  temperature=cfg.temperature, mode=cfg.mode, threads=1,
                  json_schema=cfg.json_schema)  # for the rows that name a constraint
    try:
        urls: dict[tuple[int, float, str], str] = {}
        direct: dict[tuple[int, str], str] = {}  # each target's server, by transport
        schemes = {"websocket": "ws", "grpc": "grpc", "http": "http"}
        for t, target in enumerate(targets):
            server, ports = start_server(replace(cfg, target=target), tuple(cfg.transports))
            servers.append(server)
            for rtt in cfg.rtt_ms:
                for transport, port in ports.items():
                    key = (t, rtt, transport)
                    if rtt > 0 or cfg.jitter_ms > 0:  # RTT 0 talks to the server directly
                        proxies[key] = DelayProxy(cfg.host, port, rtt / 2,
                                                  cfg.jitter_ms / 2).start()
                    port_here = proxies[key].port if key in proxies else port
                    direct[(t, transport)] = f"{schemes[transport]}://{cfg.host}:{port}"
                    urls[key] = f"{schemes[transport]}://{cfg.host}:{port_here}"
        plan: list[dict[str, Any]] = []
        # The target's bare forward over as many positions as a pass can verify (the longest
        # draft, auto's longest for k=auto, times the tree width, and the bonus position),
        # for the tax; on the built-in engine, whose backend the bare worker loads.
        longest = max(k if isinstance(k, int) else EdgeOptions().k_max for k in cfg.ks)
        positions = longest * max(cfg.trees) + 1
        for t, target in enumerate(targets):
            tag = f" [{label(target)}]" if pairs else ""
            if cfg.engine == "builtin":
                workers[f"bare{t}"] = Worker({**common, "kind": "bare", "target": target,
                                              "device": cfg.device, "positions": positions,
                                              "repeat": 5})
                plan.append({"kind": "bare", "worker": f"bare{t}", "tag": tag,
                             "target": label(target)})
            if cfg.baselines and model_format(target) == "hf":
                workers[f"target{t}"] = Worker({**common, "kind": "target", "target": target})
                plan.append({"kind": "target", "worker": f"target{t}", "tag": tag,
                             "target": label(target)})
                for d, draft in enumerate(drafts):
                    if model_format(draft) == "hf":
                        key = f"assisted{d}.{t}"
                        workers[key] = Worker({**common, "kind": "assisted", "target": target,
                                               "draft": draft})
                        plan.append({"kind": "assisted", "worker": key,
                                     "tag": f" [{label(draft)} → {label(target)}]" if pairs
                                     else ""})
            if cfg.json_schema and cfg.engine == "builtin":  # the server's backend, masked
                workers[f"alone{t}"] = Worker({**common, "kind": "alone", "target": target,
                                               "device": cfg.device})
                plan.append({"kind": "alone", "worker": f"alone{t}", "target": label(target),
                             "constraint": "json_schema", "tag": tag + SCHEMA_TAG})
            if cfg.baselines and model_format(target) == "llama.cpp":
                for kind in ("llama_alone", "llama_lookup"):
                    key = f"{kind}{t}"
                    workers[key] = Worker({**common, "kind": kind, "target": target})
                    plan.append({"kind": kind, "worker": key, "tag": tag,
                                 "target": label(target)})
                binary = llama_speculative_binary()
                for d, draft in enumerate(drafts):
                    # the peer with the same GGUF pair
                    if binary and model_format(draft) == "llama.cpp":
                        key = f"llama_speculative{d}.{t}"
                        workers[key] = Worker({**common, "kind": "llama_speculative",
                                               "target": target, "draft": draft,
                                               "binary": binary})
                        plan.append({"kind": "llama_speculative", "worker": key,
                                     "target": label(target),
                                     "tag": f" [{label(draft)} → {label(target)}]"})
        for d, draft in enumerate(drafts):
            workers[f"spececd{d}"] = Worker({**common, "kind": "spececd", "draft": draft,
                                             "target": targets[0]})
        for (t, rtt, transport), url in urls.items():
            target = targets[t]
            over = f" over {transport}" if len(cfg.transports) > 1 else ""
            # The server's own metrics, read straight from it (not through the delay proxy)
            metrics_url = direct.get((t, "websocket")) or direct.get((t, "http"))
            cloud = {"kind": "cloud", "rtt_ms": rtt, "server": url, "worker": "spececd0",
                     "metrics": metrics_url, "target": label(target), "transport": transport,
                     "tag": (f" [{label(target)}]" if pairs else "") + over}
            plan.append(cloud)
            if cfg.json_schema:
                plan.append({**cloud, "constraint": "json_schema",
                             "tag": cloud["tag"] + SCHEMA_TAG})
            for d, draft in enumerate(drafts):
                # Every proactive setting for k=auto; fixed k values with the first one
                # only (the comparison that matters there is against the policy). Trees
                # for every setting (stream drafting's hints carry them too).
                spec = {"kind": "spececd", "rtt_ms": rtt, "server": url,
                        "metrics": metrics_url, "worker": f"spececd{d}",
                        "target": label(target), "transport": transport,
                        "tag": (f" [{label(draft)} → {label(target)}]" if pairs else "") + over}
                plan += [{**spec, "k": k, "proactive": proactive,
                          "tree": width if width > 1 else None,
                          "draft_source": source if source != "auto" else None}
                         for source in cfg.sources
                         for k in cfg.ks for proactive in
                         (cfg.proactive if k == "auto" else cfg.proactive[:1])
                         for width in cfg.trees]
                if cfg.json_schema:  # the first k and setting, drafting under it or not
                    plan += [{**spec, "k": cfg.ks[0], "proactive": cfg.proactive[0],
                              "constraint": "json_schema", "constrained_drafting": drafting,
                              "tag": spec["tag"] + SCHEMA_TAG
                              + ("" if drafting else UNCONSTRAINED_TAG)}
                             for drafting in (True, False)]
        results: dict[str, dict[str, Any]] = {name(p): {**p, "passes": [], "server": []}
                                              for p in plan}
        bar = _progress(len(plan) * (cfg.iterations + 1), progress)
        started = time.time()
        for iteration in range(cfg.iterations + 1):
            order = plan if iteration % 2 == 0 else plan[::-1]
            for entry in order:
                request = {**entry, "pass": iteration, "limit": 2 if iteration == 0 else None}
                measured = iteration > 0  # the first pass is the warm-up
                before = metrics(entry["metrics"]) if measured and entry.get("metrics") else {}
                passed = workers[entry["worker"]].run(request)
                if measured:
                    results[name(entry)]["passes"].append(passed)
                    if before:  # what the server counted during this pass
                        after = metrics(entry["metrics"])
                        results[name(entry)]["server"].append(
                            {key: after[key] - before.get(key, 0.0) for key in after
                             if key.startswith("spececd_pass")
                             and key.endswith(("_sum", "_count"))})
                bar.update(1)
                bar.set_postfix_str(name(entry))
        bar.close()
        return {"meta": {"draft": ", ".join(drafts), "target": ", ".join(targets),
                         "seed": cfg.seed,
                         "backend": ", ".join(sorted({model_format(m)
                                                      for m in [*drafts, *targets]})),
                         "transport": ", ".join(cfg.transports), "device": cfg.device,
                         "rtt_ms": cfg.rtt_ms, "jitter_ms": cfg.jitter_ms, "ks": cfg.ks,
                         "proactive": cfg.proactive, "trees": cfg.trees,
                         "sources": cfg.sources,
                         "json_schema": cfg.json_schema,
                         "mode": cfg.mode, "temperature": cfg.temperature,
                         "max_tokens": cfg.max_tokens, "iterations": cfg.iterations,
                         "num_prompts": len(cfg.prompts), "machine": machine(),
                         "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)),
                         "duration_s": round(time.time() - started, 1)},
                "configs": results}
    finally:
        for worker in workers.values():
            worker.close()
        for proxy in proxies.values():
            proxy.stop()
        for server in servers:
            server.terminate()
            server.wait(10)


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return _NoBar()
    return tqdm(total=total, desc="bench passes", unit="pass", file=sys.stderr)


def save(raw: dict[str, Any], out: Path) -> dict[str, Any]:
    from spececd.bench import report

    out.mkdir(parents=True, exist_ok=True)
    summary = report.summarise(raw)
    (out / "bench.json").write_text(json.dumps({"summary": summary, "raw": raw}, indent=1))
    (out / "bench.csv").write_text(report.to_csv(summary))
    (out / "bench.md").write_text(report.to_markdown(summary, raw["meta"]))
    report.plots(summary, out)
    return summary
