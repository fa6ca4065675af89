"""Concurrent clients against `spececd api`, with variants side by side. The measurement
itself is `spececd bench --api-rows`'s (:mod:`spececd.bench.api`: four clients streaming
24 completions of 48 tokens after 32 random token ids, greedy); this script runs it for
several variants of the processes' flags and environment, alternated ``--rounds`` times,
with vLLM's own benchmark client (``vllm bench serve``'s modules) when vLLM is installed,
else the bench's own client. Setups:

- ``two-process``: ``spececd api --server ws://...`` in front of ``spececd serve`` on the
  same machine (issue 39's measurement);
- ``in-process``: ``spececd api``, the target in the same process.

A variant is a name, then ``edge:`` / ``server:`` flags and ``env:`` settings, e.g.
``threads1=edge:--threads 1,server:--threads 1``. Prints one line per run and the median
per variant: output tokens/s, median TTFT and TPOT (ms).

    python scripts/bench-concurrent.py --setups two-process,in-process \\
        --variant default= --variant omp2=edge:--threads 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spececd.bench import api
from spececd.cli.options import default_model


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(api.SETUPS))
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=edge:FLAGS,server:FLAGS,env:K=V (repeatable; default: default=)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--client", choices=["auto", "vllm", "own"], default="auto")
    p.add_argument("--draft-model", default=default_model("draft"))
    p.add_argument("--target-model", default=default_model("target"))
    p.add_argument("--num-prompts", type=int, default=api.NUM_REQUESTS)
    p.add_argument("--concurrency", type=int, default=api.CONCURRENCY)
    p.add_argument("--input-len", type=int, default=api.INPUT_LEN)
    p.add_argument("--output-len", type=int, default=api.OUTPUT_LEN)
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
    prompts = api.random_prompts(args.seed, args.num_prompts, args.input_len)
    setups = args.setups.split(",")
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for setup in setups:
            for variant in variants:
                procs = api.start(setup, args.draft_model, args.target_model,
                                  edge=variant.edge, server=variant.server, env=variant.env)
                try:
                    url = procs[-1].url
                    figures = (api.vllm_client(url, args.target_model, args.seed,
                                               args.num_prompts, args.input_len,
                                               args.output_len, args.concurrency)
                               if client == "vllm" else
                               api.concurrent(url, prompts, args.output_len, args.concurrency,
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
    for setup in setups:
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
