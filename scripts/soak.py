#!/usr/bin/env python3
"""A soak with faults: many edge clients against two `spececd serve` replicas behind nginx
for minutes, with clients that vanish mid-generation, one replica SIGKILLed and restarted,
and the other drained (SIGTERM) and restarted; what the servers hold is sampled over time.

Clients (threads of this process, drafting by lookup, greedy, over WebSocket through nginx)
loop until the end, each generation checked against the target alone's tokens
(transformers' greedy, computed here first). In a share of them (``--vanish``) the link
drops at a random moment (the socket shut without a close: mid-prefill, mid-round or
mid-stream, as timing falls): the server sees a client vanish, and the edge reconnects
through nginx with its history and must still end with the same tokens. So does a
generation whose replica dies. Other clients (``--gone``) vanish for good: each of their
generations opens a link of its own, shuts its socket at a moment chosen for a stage
(mid-prefill of a long prompt, mid-round, mid-stream) and never comes back, so what it
held on the server must be freed by the server alone. Every sample (each
``--sample-s``) reads, for each replica, its RSS, open file descriptors and threads from
``/proc`` and its sessions, KV bytes and asyncio tasks from ``/status``; every round's
latency (a draft to its verdict) is kept by the second.

It ends with a JSON report and a plot (memory, sessions and KV over time), and exits 1 if
any generation differed from the reference, hung, or failed without a typed error; or if
sessions or KV bytes are left once the clients are gone.

usage: python scripts/soak.py [--minutes 10] [--clients 32] [--gone 4] [--out soak-out]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from spececd import processes
from spececd.deploy import Ports, loopback, nginx_conf
from spececd.edge.transport import Transport
from spececd.errors import SpecECDError
from spececd.generator import Generator
from spececd.protocol import messages as m
from spececd.transports.registry import connector

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "models" / "target"
MAX_TOKENS = 48
HANG_S = 120.0  # a generation taking longer than this has hung


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Replica:
    """One `spececd serve` on its own ports, bound to this process's life."""

    def __init__(self, ports: Ports) -> None:
        self.ports = ports
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(processes.bound(
            [sys.executable, "-m", "spececd", "serve", "--target-model", str(TARGET),
             "--port", str(self.ports.websocket), "--grpc-port", "-1", "--http-port", "-1",
             "--dtype", "float32", "--threads", "1", "--max-sessions", "256",
             "--idle-timeout", "30", "--drain-timeout", "10"]),
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "serving" in line:
                break
        else:
            raise RuntimeError(f"replica on {self.ports.websocket} did not start")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # drained

    def status(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports.websocket}/status",
                                        timeout=5) as reply:
                return json.loads(reply.read())  # type: ignore[no-any-return]
        except OSError:
            return None

    def pool_pages(self) -> int | None:
        """The KV page pool's size in pages (``/metrics``: used and free), which grows by
        doubling up to its limit and is kept: memory held by design, not a leak."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports.websocket}/metrics",
                                        timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        values = [float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith(("spececd_kv_pages_used ", "spececd_kv_pages_free "))]
        return int(sum(values)) if len(values) == 2 else None

    def proc_sample(self) -> dict[str, float]:
        """RSS (MiB), open descriptors and threads of the server process (``/proc``)."""
        if self.proc is None or self.proc.poll() is not None:
            return {}
        pid = self.proc.pid
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
                    "threads": int(fields["Threads"]),
                    "fds": len(os.listdir(f"/proc/{pid}/fd"))}
        except (OSError, KeyError, ValueError):
            return {}


class Timed:
    """A transport that records each round's latency (a send to the verdict that answers
    it: greetings, whose welcome waits for the prompt's prefill, and streams' pushed tokens
    are no rounds) and can be shut from another thread, as a client vanishing shuts its
    socket."""

    def __init__(self, inner: Transport, latencies: list[tuple[float, float]]) -> None:
        self.inner, self.latencies = inner, latencies
        self.sent: float | None = None

    def send(self, frame: bytes) -> None:
        self.sent = time.monotonic()
        self.inner.send(frame)

    def recv(self) -> bytes:
        frame = self.inner.recv()
        if self.sent is not None:
            now = time.monotonic()
            with contextlib.suppress(Exception):  # the edge reports a frame it cannot read
                if isinstance(m.decode(frame), m.Verdict):
                    self.latencies.append((now, now - self.sent))
            self.sent = None
        return frame

    def vanish(self) -> bool:
        """Shut the socket under the link (no close frame); whether one was open."""
        ws = getattr(self.inner, "_ws", None)
        if ws is None:
            return False
        try:
            ws.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def references(prompts: list[str]) -> dict[str, list[int]]:
    """The target alone's greedy tokens for each prompt (transformers, float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    out = {}
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        out[prompt] = generated[0, len(ids):].tolist()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--vanish", type=float, default=0.2, help="share of generations that vanish")
    p.add_argument("--gone", type=int, default=4,
                   help="clients more, whose every generation vanishes for good (each "
                   "followed by 1-4 s before the next, as new users arrive)")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    args = p.parse_args()
    with processes.ended_with_this_one():
        return soak(args)


def soak(args: argparse.Namespace) -> int:
    prompts = [*json.loads((REPO / "models" / "heldout_prompts.json").read_text())[:12],
               *(p["prompt"] if isinstance(p, dict) else p for p in json.loads(
                   (REPO / "models" / "copy_prompts.json").read_text())[:4])]
    long_prompt = " ".join(prompts[:7])  # a prefill of ~360 tokens (of 512), in chunks
    print(f"references for {len(prompts) + 1} prompts...", flush=True)
    expected = references([*prompts, long_prompt])
    free = free_ports(9)  # WebSocket is served; nginx wants the other ports named too
    replicas = [Replica(Ports(*free[0:3])), Replica(Ports(*free[3:6]))]
    listen = Ports(*free[6:9])
    runtime = Path(tempfile.mkdtemp(prefix="spececd-soak-"))
    runtime.chmod(0o755)
    conf = runtime / "nginx.conf"
    conf.write_text(nginx_conf(loopback([r.ports for r in replicas], listen), str(runtime),
                               "127.0.0.1"))
    for replica in replicas:
        replica.start()
    nginx = subprocess.Popen(processes.bound(["nginx", "-c", str(conf)]),
                             stderr=subprocess.PIPE, text=True)
    url = f"ws://127.0.0.1:{listen.websocket}"
    time.sleep(1.0)
    if nginx.poll() is not None:
        assert nginx.stderr is not None
        raise RuntimeError(f"nginx did not start: {nginx.stderr.read()}")
    duration = args.minutes * 60
    started = time.monotonic()
    end = started + duration
    lock = threading.Lock()
    counts = {"done": 0, "identical": 0, "differed": 0, "dropped": 0, "vanished": 0,
              "typed_errors": 0, "untyped_errors": 0, "hung": 0, "reconnects": 0, "tokens": 0,
              "gone": 0, "gone_too_late": 0}
    failures: list[str] = []
    latencies: list[tuple[float, float]] = []
    token_times: list[tuple[float, int]] = []

    def client(i: int) -> None:
        rng = random.Random(i)
        transports: list[Timed] = []
        connect = connector(url, recv_timeout=60)

        def timed() -> Transport:
            t = Timed(connect(), latencies)
            transports.append(t)
            return t

        gen = Generator.remote(None, url, timed, options=None)
        gen.options = gen.options.with_settings(draft_source="lookup", proactive="off"
                                                if i % 2 else "auto")
        while time.monotonic() < end:
            prompt = rng.choice(prompts)
            vanish = rng.random() < args.vanish
            if vanish:  # shut the socket at a random moment, as a link that drops
                def drop() -> None:
                    if transports and transports[-1].vanish():  # the link in use
                        with lock:
                            counts["dropped"] += 1

                threading.Timer(rng.uniform(0.0, 1.0), drop).start()
            began = time.monotonic()
            try:
                out = gen.generate(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   stop_token_ids=[], token_healing=False)
            except SpecECDError as exc:
                with lock:
                    counts["vanished" if vanish else "typed_errors"] += 1
                    if not vanish:
                        failures.append(f"client {i}: {type(exc).__name__}: {exc}")
                continue
            except Exception as exc:  # a soak reports what it finds
                with lock:
                    counts["vanished" if vanish else "untyped_errors"] += 1
                    if not vanish:
                        failures.append(f"client {i}: {type(exc).__name__}: {exc}")
                continue
            seconds = time.monotonic() - began
            with lock:
                counts["done"] += 1
                counts["reconnects"] += out.stats.reconnects
                counts["tokens"] += len(out.token_ids)
                token_times.append((time.monotonic(), len(out.token_ids)))
                if seconds > HANG_S:
                    counts["hung"] += 1
                if list(out.token_ids) == expected[prompt]:
                    counts["identical"] += 1
                elif not vanish:  # a vanished socket that reconnected still must match
                    counts["differed"] += 1
                    failures.append(f"client {i}: {prompt[:30]!r} differs")
                else:
                    counts["differed"] += 1
                    failures.append(f"client {i} (vanish resumed): {prompt[:30]!r} differs")
            del transports[:-1]  # the link goes on to the next generation
        gen.close()

    def gone_client(i: int) -> None:
        """Generations that vanish for good: one link each, no reconnection, the socket
        shut at a moment chosen for a stage; a generation that ends first is checked."""
        rng = random.Random(10_000 + i)
        links: list[Timed] = []
        connect = connector(url, recv_timeout=60)

        def one_link() -> Transport:
            links.append(Timed(connect(), latencies))
            return links[-1]

        gen = Generator.remote(None, url, one_link, options=None)
        stages = {"prefill": (long_prompt, "off", 0.0, 0.15),
                  "round": (None, "off", 0.1, 1.0), "stream": (None, "stream", 0.1, 1.0)}
        while time.monotonic() < end:
            time.sleep(rng.uniform(1.0, 4.0))  # the next user to arrive and vanish
            prompt, proactive, soonest, latest = stages[rng.choice(list(stages))]
            prompt = prompt or rng.choice(prompts)
            gen.options = gen.options.with_settings(
                draft_source="lookup", proactive=proactive, reconnect_attempts=0)
            links.clear()
            shut = threading.Event()

            def vanish(shut: threading.Event = shut) -> None:
                shut.set()  # before the socket is shut: the generation may fail at once
                if not (links and links[-1].vanish()):
                    shut.clear()  # no socket open: nothing was shut

            timer = threading.Timer(rng.uniform(soonest, latest), vanish)
            timer.start()
            try:
                out = gen.generate(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   stop_token_ids=[], token_healing=False)
            except SpecECDError as exc:
                with lock:
                    if shut.is_set():
                        counts["gone"] += 1
                    else:  # an error of the server's own, not the vanishing
                        counts["typed_errors"] += 1
                        failures.append(f"gone client {i}: {type(exc).__name__}: {exc}")
                continue
            except Exception as exc:  # a soak reports what it finds
                with lock:
                    counts["untyped_errors"] += 1
                    failures.append(f"gone client {i}: {type(exc).__name__}: {exc}")
                continue
            finally:
                timer.cancel()
            with lock:
                counts["gone_too_late"] += 1  # it ended before its socket was shut
                if list(out.token_ids) != expected[prompt]:
                    counts["differed"] += 1
                    failures.append(f"gone client {i}: {prompt[:30]!r} differs")
            gen.close()  # the next generation starts on a link of its own
            gen = Generator.remote(None, url, one_link, options=None)

    samples: list[dict[str, Any]] = []

    def sample() -> None:
        now = time.monotonic() - started
        row: dict[str, Any] = {"t": round(now, 1)}
        for j, replica in enumerate(replicas):
            row[f"r{j}"] = {**replica.proc_sample(), **{
                k: v for k, v in (replica.status() or {}).items()
                if k in ("sessions", "kv_bytes", "tasks")}, "pool_pages": replica.pool_pages()}
        with lock:
            window = [lat for at, lat in latencies if at > time.monotonic() - args.sample_s]
            tokens = sum(n for at, n in token_times if at > time.monotonic() - args.sample_s)
        row["tokens_per_s"] = tokens / args.sample_s
        if len(window) >= 20:
            row["round_p50_ms"] = 1e3 * statistics.median(window)
            row["round_p99_ms"] = 1e3 * statistics.quantiles(window, n=100)[98]
        samples.append(row)
        print(json.dumps(row), flush=True)

    faults: list[dict[str, Any]] = []

    def fault(what: str) -> None:
        faults.append({"t": round(time.monotonic() - started, 1), "what": what})
        print(json.dumps(faults[-1]), flush=True)

    def kill_and_restart() -> None:
        victim = replicas[0]
        assert victim.proc is not None
        fault("SIGKILL replica 0")
        victim.proc.kill()
        victim.proc.wait()
        time.sleep(2.0)
        victim.start()
        fault("replica 0 back")

    def drain_and_restart() -> None:
        drained = replicas[1]
        assert drained.proc is not None
        fault("SIGTERM replica 1 (drain)")
        drained.proc.send_signal(signal.SIGTERM)
        drained.proc.wait(60)
        drained.start()
        fault("replica 1 back")

    # Run by the main thread, which starts the replicas again: a child bound to this
    # process ends with the thread that started it (spececd.processes.end_with_parent).
    plan = [(started + duration / 3, kill_and_restart),
            (started + 2 * duration / 3, drain_and_restart)]

    threads = [*(threading.Thread(target=client, args=(i,), daemon=True)
                 for i in range(args.clients)),
               *(threading.Thread(target=gone_client, args=(i,), daemon=True)
                 for i in range(args.gone))]
    try:
        for thread in threads:
            thread.start()
        while time.monotonic() < end:
            time.sleep(args.sample_s)
            sample()
            while plan and time.monotonic() >= plan[0][0]:
                plan.pop(0)[1]()
        for thread in threads:
            thread.join(HANG_S)
        counts["hung"] += sum(thread.is_alive() for thread in threads)
        time.sleep(35.0)  # past the idle timeout: whatever a vanished client left is gone
        sample()
    finally:
        nginx.terminate()
        nginx.wait(10)
        for replica in replicas:
            if replica.proc is not None:
                replica.proc.terminate()
                replica.proc.wait(30)
        shutil.rmtree(runtime, ignore_errors=True)
    rounds = [(at - started, latency) for at, latency in latencies]
    return report(args, samples, faults, counts, failures, rounds)


def report(args: argparse.Namespace, samples: list[dict[str, Any]],
           faults: list[dict[str, Any]], counts: dict[str, int], failures: list[str],
           rounds: list[tuple[float, float]]) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    last = samples[-1]
    left = {j: (last[f"r{j}"].get("sessions"), last[f"r{j}"].get("kv_bytes")) for j in (0, 1)}
    # RSS growth within each steady stretch (between faults, its first minute left out as
    # warm-up: sessions move between the replicas at a fault, and memory follows them).
    cuts = [0.0, *(f["t"] for f in faults), samples[-1]["t"]]
    growth: dict[str, list[float]] = {}
    for j in (0, 1):
        key = f"r{j}"
        for start, stop in itertools.pairwise(cuts):
            rss = [s[key]["rss_mib"] for s in samples
                   if start + 60 <= s["t"] <= stop and s[key].get("rss_mib")]
            if len(rss) >= 2:
                growth.setdefault(key, []).append(round(rss[-1] / rss[0] - 1, 4))
    # The same from where the page pool reached the stretch's last size (a pool that grows
    # holds more memory by design; a leak grows while it does not), over a minute or more.
    at_steady_pool: dict[str, list[dict[str, float]]] = {}
    for j in (0, 1):
        key = f"r{j}"
        for start, stop in itertools.pairwise(cuts):
            rows = [s[key] | {"t": s["t"]} for s in samples
                    if start + 60 <= s["t"] <= stop and s[key].get("rss_mib")]
            if not rows or rows[-1].get("pool_pages") is None:
                continue
            steady = rows[next(i for i, r in enumerate(rows)
                               if r["pool_pages"] == rows[-1]["pool_pages"]):]
            if steady[-1]["t"] - steady[0]["t"] >= 60:
                at_steady_pool.setdefault(key, []).append({
                    "from_s": steady[0]["t"], "to_s": steady[-1]["t"],
                    "growth": round(steady[-1]["rss_mib"] / steady[0]["rss_mib"] - 1, 4)})
    p99 = [s["round_p99_ms"] / s["round_p50_ms"] for s in samples if "round_p99_ms" in s]
    # Every round of the run outside the restarts (from each fault to 30 s after the
    # replica is back: the edges' reconnections and the history they send again).
    restarts = [(f["t"], back["t"] + 30.0) for f, back in itertools.pairwise(faults)
                if back["what"].endswith("back")]
    steady = sorted(latency for at, latency in rounds
                    if not any(start <= at <= stop for start, stop in restarts))
    overall = ({"p50_ms": round(1e3 * statistics.median(steady), 1),
                "p99_ms": round(1e3 * statistics.quantiles(steady, n=100)[98], 1),
                "exchanges": len(steady)} if len(steady) >= 100 else {})
    if overall:
        overall["p99_over_p50"] = round(overall["p99_ms"] / overall["p50_ms"], 2)
    result = {"minutes": args.minutes, "clients": args.clients, "vanish": args.vanish,
              "gone": args.gone,
              "counts": counts, "faults": faults, "left_at_end": left,
              "rss_growth_by_steady_stretch": growth,
              "rss_growth_at_steady_pool": at_steady_pool,
              "round_p99_over_p50_median": round(statistics.median(p99), 2) if p99 else None,
              "rounds_outside_restarts": overall,
              "failures": failures[:50], "samples": samples}
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    with contextlib.suppress(ImportError):  # the plot where matplotlib is installed
        plot(samples, faults, args.out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    bad = (counts["differed"] or counts["untyped_errors"] or counts["hung"]
           or any(s or kv for s, kv in left.values()))
    return 1 if bad else 0


def plot(samples: list[dict[str, Any]], faults: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    t = [s["t"] for s in samples]
    for j in (0, 1):
        key = f"r{j}"
        axes[0].plot(t, [s[key].get("rss_mib") for s in samples], label=f"replica {j}")
        axes[1].plot(t, [s[key].get("sessions") for s in samples], label=f"replica {j}")
        axes[2].plot(t, [(s[key].get("kv_bytes") or 0) / 2**20 for s in samples],
                     label=f"replica {j}")
    axes[3].plot(t, [s.get("tokens_per_s") for s in samples], label="tokens/s (clients)")
    axes[3].plot(t, [s.get("round_p99_ms") for s in samples], label="round p99 ms")
    for ax, name in zip(axes, ("RSS (MiB)", "sessions", "KV (MiB)", "tokens/s, p99 ms"),
                        strict=True):
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
        for f in faults:
            ax.axvline(f["t"], color="grey", linestyle=":", linewidth=0.8)
    axes[-1].set_xlabel("seconds")
    axes[0].set_title("spececd serve x2 behind nginx: a soak with vanishing clients, "
                      "a SIGKILL and a drain", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
