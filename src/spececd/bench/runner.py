"""`spececd bench`: every configuration side by side, in one run, alternating order.

Processes: the verifier server (``spececd serve``, one torch thread), one delay proxy per
RTT in front of it (:mod:`spececd.bench.netem`, run in this process), and three workers
(:mod:`spececd.bench.worker`, one torch thread each): the target on transformers (the
target alone, and transformers' assisted generation), the target on the server's backend
(the bare forward, and the target alone under a JSON schema), and the SpecECD edge (which
also runs the cloud-only passes); with ``api_rows``, two more that each start ``spececd
api`` as a user does (:mod:`spececd.bench.api`). The target runs on ``device`` in
``dtype`` everywhere (the server, the target alone, the bare forward, assisted
generation); the edge's draft on ``draft_device``.
Each pass runs one configuration over all prompts; passes alternate their order
(forward, then reversed) so that drift on the machine hits every configuration alike.
The first pass of each configuration is a warm-up on two prompts and is not counted.

The processes are started by :mod:`spececd.bench.processes`: every start and load time is
logged as it happens, and every wait on one has the stall limit of
:mod:`spececd.bench.child` (a process that shows no progress within ``stall_s`` stops the
run with an error that names it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from spececd.backends.registry import model_format
from spececd.bench import api
from spececd.bench.child import STALL_S, kill
from spececd.bench.load import metrics
from spececd.bench.netem import DelayProxy
from spececd.bench.processes import Server, Worker, label, resolved_dtype
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
    device: str = "cpu"  # the target's, everywhere it runs
    dtype: str = "auto"  # the target's: auto is float32 on a CPU, bfloat16 on a GPU
    draft_device: str = "cpu"  # the edge's draft
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
    # The transformers form of a draft that is not one (the default draft's folder when
    # the default runs on a faster runtime): transformers' assisted generation drafts with it
    assisted_draft: str | None = None
    stall_s: float = STALL_S  # a process that shows no progress for this long stops the run
    api_rows: bool = False  # the rows measured through `spececd api` (spececd.bench.api)
    # The server's `--token-budget` (auto, off or a number); None: not passed (its default)
    token_budget: str | None = None
    # A code-edit set (its JSON file): Predicted Outputs' rows through `spececd api`
    edit_set: str | None = None


def config_name(kind: str, rtt: float | None = None, k: int | str | None = None,
                proactive: str | None = None, tree: int | None = None,
                source: str | None = None) -> str:
    name = {"target": "target alone", "alone": "target alone", "assisted": "HF assisted",
            "cloud": "cloud-only",
            "spececd": "SpecECD", "bare": "target's bare forward",
            "llama_alone": "llama.cpp target alone",
            "llama_lookup": "llama.cpp prompt-lookup speculative",
            "llama_speculative": "llama.cpp speculative (draft model, in-process)",
            "api_concurrent": "OpenAI API", "api_chat": "OpenAI API chat",
            "api_edit": "OpenAI API code edits"}[kind]
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


def machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads_per_process": 1, "gpu": gpu}


def name(entry: dict[str, Any]) -> str:
    return config_name(entry["kind"], entry.get("rtt_ms"), entry.get("k"),
                       entry.get("proactive"), entry.get("tree"),
                       entry.get("draft_source")) + entry.get("tag", "")


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
    assisted baselines run for transformers models only. Every server and worker loads at
    once (on a 2-core CPU the default suite's bench started in 20 s instead of 41)."""
    drafts, targets = cfg.drafts or [cfg.draft], cfg.targets or [cfg.target]
    pairs = len(drafts) > 1 or len(targets) > 1
    servers: list[subprocess.Popen[str]] = []
    proxies: dict[tuple[int, float, str], DelayProxy] = {}
    workers: dict[str, Worker] = {}
    common = dict(prompts=cfg.prompts, seed=cfg.seed, max_tokens=cfg.max_tokens,
                  temperature=cfg.temperature, mode=cfg.mode, threads=1,
                  device=cfg.device, dtype=cfg.dtype, draft_device=cfg.draft_device,
                  json_schema=cfg.json_schema)  # for the rows that name a constraint

    def start(key: str, what: str, **job: Any) -> None:
        # every process loads at once: the servers and workers are waited for after
        workers[key] = Worker({**common, **job}, what, cfg.stall_s, wait=False)

    try:
        launched: list[Server] = []
        for target in targets:
            launched.append(Server(replace(cfg, target=target), tuple(cfg.transports)))
            servers.append(launched[-1].proc)
        if cfg.engine == "vllm" or cfg.device != "cpu":  # the device's memory: servers first
            for server in launched:
                server.ports()
        plan: list[dict[str, Any]] = []
        # The target's bare forward over as many positions as a pass can verify (the longest
        # draft, auto's longest for k=auto, times the tree width, and the bonus position),
        # for the tax; on the built-in engine, whose backend the bare worker loads.
        longest = max(k if isinstance(k, int) else EdgeOptions().k_max for k in cfg.ks)
        positions = longest * max(cfg.trees) + 1
        for t, target in enumerate(targets):
            tag = f" [{label(target)}]" if pairs else ""
            # One worker per copy of the target: the bare forward and the target alone
            # under the schema on the server's backend; the target alone and assisted
            # generation (each draft its assistant) on transformers'.
            if cfg.engine == "builtin":
                schema = ["alone"] if cfg.json_schema else []  # the server's backend, masked
                start(f"backend{t}", f"the bare forward worker ({label(target)})" + (
                    ", and the target alone under the schema" if schema else ""),
                      kinds=["bare", *schema], target=target, positions=positions, repeat=5)
                plan.append({"kind": "bare", "worker": f"backend{t}", "tag": tag,
                             "target": label(target)})
            if cfg.baselines and model_format(target) == "hf":
                assisted = ([d for d in drafts if model_format(d) == "hf"]
                            or [d for d in [cfg.assisted_draft] if d])
                start(f"hf{t}", f"the target alone ({label(target)}, transformers)" + (
                    f", and assisted by {', '.join(map(label, assisted))}" if assisted else ""),
                      kinds=["target"] + (["assisted"] if assisted else []), target=target,
                      drafts=assisted)
                plan.append({"kind": "target", "worker": f"hf{t}", "tag": tag,
                             "target": label(target)})
                plan += [{"kind": "assisted", "worker": f"hf{t}", "draft": draft,
                          "target": label(target),
                          "tag": f" [{label(draft)} → {label(target)}]" if pairs else ""}
                         for draft in assisted]
            if cfg.json_schema and cfg.engine == "builtin":
                plan.append({"kind": "alone", "worker": f"backend{t}", "target": label(target),
                             "constraint": "json_schema", "tag": tag + SCHEMA_TAG})
            if cfg.baselines and model_format(target) == "llama.cpp":
                for kind in ("llama_alone", "llama_lookup"):
                    key = f"{kind}{t}"
                    start(key, f"{config_name(kind)} ({label(target)})", kind=kind,
                          target=target)
                    plan.append({"kind": kind, "worker": key, "tag": tag,
                                 "target": label(target)})
                binary = llama_speculative_binary()
                for d, draft in enumerate(drafts):
                    # the peer with the same GGUF pair
                    if binary and model_format(draft) == "llama.cpp":
                        key = f"llama_speculative{d}.{t}"
                        start(key, f"llama.cpp's speculative decoding ({label(draft)} → "
                              f"{label(target)})", kind="llama_speculative", target=target,
                              draft=draft, binary=binary)
                        plan.append({"kind": "llama_speculative", "worker": key,
                                     "target": label(target),
                                     "tag": f" [{label(draft)} → {label(target)}]"})
        for d, draft in enumerate(drafts):
            start(f"spececd{d}", f"the SpecECD edge ({label(draft)} on {cfg.draft_device})",
                  kind="spececd", draft=draft, target=targets[0])
        urls: dict[tuple[int, float, str], str] = {}
        direct: dict[tuple[int, str], str] = {}  # each target's server, by transport
        schemes = {"websocket": "ws", "grpc": "grpc", "http": "http"}
        for t, server in enumerate(launched):
            ports = server.ports()
            for rtt in cfg.rtt_ms:
                for transport, port in ports.items():
                    key = (t, rtt, transport)
                    if rtt > 0 or cfg.jitter_ms > 0:  # RTT 0 talks to the server directly
                        proxies[key] = DelayProxy(cfg.host, port, rtt / 2,
                                                  cfg.jitter_ms / 2).start()
                    port_here = proxies[key].port if key in proxies else port
                    direct[(t, transport)] = f"{schemes[transport]}://{cfg.host}:{port}"
                    urls[key] = f"{schemes[transport]}://{cfg.host}:{port_here}"
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
        if cfg.api_rows or cfg.edit_set:  # through `spececd api`, started as a user does
            for setup in api.SETUPS if cfg.api_rows else ("two-process",):
                start(f"api-{setup}", f"the `spececd api` rows ({setup})", kind="api",
                      setup=setup, draft=drafts[0], target=targets[0], stall_s=cfg.stall_s,
                      edit_set=cfg.edit_set)
            plan += (api_plan() if cfg.api_rows else []) + edit_plan(cfg.edit_set)
        for worker in workers.values():
            worker.loaded()
        results: dict[str, dict[str, Any]] = {name(p): {**p, "passes": [], "server": []}
                                              for p in plan}
        bar = _progress(len(plan) * (cfg.iterations + 1), progress)
        started = time.time()
        for iteration in range(cfg.iterations + 1):
            order = plan if iteration % 2 == 0 else plan[::-1]
            for entry in order:
                request = {**entry, "pass": iteration, "limit": 2 if iteration == 0 else None}
                measured = iteration > 0  # the first pass is the warm-up
                doing = (f"pass {iteration} of {cfg.iterations}" if measured
                         else "the warm-up pass") + f" ({name(entry)})"
                before = metrics(entry["metrics"]) if measured and entry.get("metrics") else {}
                began = time.perf_counter()
                passed = workers[entry["worker"]].run(request, doing)
                if not progress:  # no bar on the terminal: a line per pass
                    tokens, took = sum(r["tokens"] for r in passed), time.perf_counter() - began
                    rate = f"{tokens} tokens in {took:.1f} s ({tokens / took:.1f} tokens/s)"
                    log.info("%s: %s", doing, rate if tokens else f"{took:.1f} s")
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
                         "dtype": ", ".join(dict.fromkeys(
                             resolved_dtype(cfg.dtype, cfg.device, t) for t in targets)),
                         "draft_device": cfg.draft_device, "stall_s": cfg.stall_s,
                         **({"api": {"requests": api.NUM_REQUESTS,
                                     "input_len": api.INPUT_LEN,
                                     "output_len": api.OUTPUT_LEN,
                                     "concurrency": api.CONCURRENCY,
                                     "chat_requests": api.CHAT_REQUESTS,
                                     "chat_max_tokens": api.CHAT_MAX_TOKENS}}
                            if cfg.api_rows else {}),
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
    finally:  # everything ends, whatever fails on the way (kill waits for the process)
        for worker in workers.values():
            with contextlib.suppress(Exception):
                worker.close()
        for proxy in proxies.values():
            with contextlib.suppress(Exception):
                proxy.stop()
        for server in servers:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                kill(server)


def api_plan() -> list[dict[str, Any]]:
    """The rows measured through ``spececd api`` (:mod:`spececd.bench.api`), each naming
    the worker of its setup: the concurrent clients in each setup, then the chat requests
    unconstrained and under the schema (in-process)."""
    plan: list[dict[str, Any]] = [
        {"kind": "api_concurrent", "worker": f"api-{setup}", "setup": setup,
         "concurrency": api.CONCURRENCY, "tag": f" ×{api.CONCURRENCY} concurrent, {setup}"}
        for setup in api.SETUPS]
    return plan + [{"kind": "api_chat", "worker": "api-in-process", "setup": "in-process",
                    "api_constrained": constrained,
                    "tag": SCHEMA_TAG if constrained else ", unconstrained"}
                   for constrained in (False, True)]


def edit_plan(edit_set: str | None) -> list[dict[str, Any]]:
    """The code-edit rows (:func:`spececd.bench.api.edit`), one per source of drafts, in
    front of ``spececd serve`` at RTT 0; none without a set."""
    if not edit_set:
        return []
    return [{"kind": "api_edit", "worker": "api-two-process", "setup": "two-process",
             "edit_source": source, "tag": f", {source}"} for source in api.EDIT_SOURCES]


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


def save(raw: dict[str, Any], out: Path) -> list[str]:
    """bench.json, bench.csv, bench.md and, where matplotlib is installed, the plots, in
    ``out``: the names of the files written."""
    from spececd.bench import report

    out.mkdir(parents=True, exist_ok=True)
    summary = report.summarise(raw)
    (out / "bench.json").write_text(json.dumps({"summary": summary, "raw": raw}, indent=1))
    (out / "bench.csv").write_text(report.to_csv(summary))
    (out / "bench.md").write_text(report.to_markdown(summary, raw["meta"]))
    written = ["bench.json", "bench.csv", "bench.md"]
    if report.draw(report.plots, summary, out):
        written += list(report.PLOTS)
    return written
