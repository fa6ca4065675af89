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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spececd.bench.netem import DelayProxy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    draft: str
    target: str
    prompts: list[str]
    rtt_ms: list[float] = field(default_factory=lambda: [0.0, 20.0, 50.0])
    ks: list[int | str] = field(default_factory=lambda: ["auto"])  # ints or "auto"
    proactive: list[bool] = field(default_factory=lambda: [False, True])
    iterations: int = 3
    max_tokens: int = 64
    temperature: float = 0.0
    mode: str = "exact"
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    jitter_ms: float = 0.0
    baselines: bool = True  # run the target alone and transformers' assisted generation
    max_batch: int = 32  # the server's sessions per forward pass


def config_name(kind: str, rtt: float | None = None, k: int | str | None = None,
                proactive: bool | None = None) -> str:
    name = {"target": "target alone", "assisted": "HF assisted", "cloud": "cloud-only",
            "spececd": "SpecECD"}[kind]
    if k is not None:
        name += f" k={k}"
    if proactive is not None:
        name += " proactive" if proactive else " plain"
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


def start_server(cfg: BenchConfig) -> tuple[subprocess.Popen[str], int]:
    """``spececd serve`` for ``cfg.target``; its stderr is drained by a thread once it runs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spececd", "serve", "--target-model", cfg.target, "--host",
         cfg.host, "--port", str(cfg.port), "--device", cfg.device, "--threads", "1",
         "--dtype", "float32", "--max-batch", str(cfg.max_batch), "--max-sessions", "256"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stderr is not None
    for line in proc.stderr:
        if "serving" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr or []],  # drain
                             daemon=True).start()
            return proc, int(line.rsplit(":", 1)[1].split()[0])
    raise RuntimeError(f"the verifier server did not start: exit {proc.wait()}")


def machine() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads_per_process": 1}


def name(entry: dict[str, Any]) -> str:
    return config_name(entry["kind"], entry.get("rtt_ms"), entry.get("k"),
                       entry.get("proactive"))


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run every configuration and return the raw results (see report.summarise)."""
    server, port = start_server(cfg)
    # RTT 0 talks to the server directly; the others through a delay proxy each.
    proxies = {rtt: DelayProxy(cfg.host, port, rtt / 2, cfg.jitter_ms / 2).start()
               for rtt in cfg.rtt_ms if rtt > 0 or cfg.jitter_ms > 0}
    common = dict(draft=cfg.draft, target=cfg.target, prompts=cfg.prompts, seed=cfg.seed,
                  max_tokens=cfg.max_tokens, temperature=cfg.temperature, mode=cfg.mode,
                  threads=1)
    workers: dict[str, Worker] = {}
    try:
        if cfg.baselines:
            workers["target"] = Worker({**common, "kind": "target"})
            workers["assisted"] = Worker({**common, "kind": "assisted"})
        workers["spececd"] = Worker({**common, "kind": "spececd"})
        plan: list[dict[str, Any]] = []
        if cfg.baselines:
            plan += [{"kind": "target"}, {"kind": "assisted"}]
        for rtt in cfg.rtt_ms:
            url = f"ws://{cfg.host}:{proxies[rtt].port if rtt in proxies else port}"
            plan.append({"kind": "cloud", "rtt_ms": rtt, "server": url})
            # Every proactive setting for k=auto; fixed k values with the first setting only
            # (the comparison that matters there is against the adaptive policy).
            plan += [{"kind": "spececd", "rtt_ms": rtt, "server": url, "k": k,
                      "proactive": proactive} for k in cfg.ks
                     for proactive in (cfg.proactive if k == "auto" else cfg.proactive[:1])]
        results: dict[str, dict[str, Any]] = {name(p): {**p, "passes": []} for p in plan}
        bar = _progress(len(plan) * (cfg.iterations + 1), progress)
        started = time.time()
        for iteration in range(cfg.iterations + 1):
            order = plan if iteration % 2 == 0 else plan[::-1]
            for entry in order:
                worker = workers["spececd" if entry["kind"] in ("cloud", "spececd")
                                 else entry["kind"]]
                request = {**entry, "pass": iteration, "limit": 2 if iteration == 0 else None}
                passed = worker.run(request)
                if iteration > 0:  # the first pass is the warm-up
                    results[name(entry)]["passes"].append(passed)
                bar.update(1)
                bar.set_postfix_str(name(entry))
        bar.close()
        return {"meta": {"draft": cfg.draft, "target": cfg.target, "seed": cfg.seed,
                         "backend": "hf", "transport": "websocket", "device": cfg.device,
                         "rtt_ms": cfg.rtt_ms, "jitter_ms": cfg.jitter_ms, "ks": cfg.ks,
                         "proactive": cfg.proactive,
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
