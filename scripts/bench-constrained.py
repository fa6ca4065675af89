"""Constrained against unconstrained output through `spececd api`, one request at a time
(issue 39: 9.4 against 31 tokens/s on a busy machine), with a checkout before a change
side by side. The requests are `spececd bench --api-rows`'s chat rows
(:mod:`spececd.bench.api`: the same message, unconstrained and under a JSON schema,
greedy); this script starts ``spececd api`` as a newcomer does (the default pair in one
process; more arguments pass through), alternates them ``--rounds`` times and prints each
request's tokens/s (the first of each kind apart: it is where a compile or any first-use
cost shows) and the medians; the ratio is the figure to watch.

    python scripts/bench-constrained.py --rounds 8
    python scripts/bench-constrained.py --before /tmp/old/src --repeat 2  # side by side
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from spececd.bench import api
from spececd.cli.options import models_dir


def measure(env: dict[str, str], args: argparse.Namespace) -> dict[str, list[float]]:
    """One ``spececd api``'s tokens/s per request, plain and constrained alternated."""
    proc = api.Process("api", args.api_args, env)
    print(proc.line)
    rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
    try:
        for round_ in range(args.rounds):
            for kind in rates:
                one = api.chat(proc.url, kind == "json_schema", args.max_tokens)
                rates[kind].append(one.tokens / one.last_s)
                print(f"{round_} {kind:11s} {one.tokens:3d} tokens {one.last_s:6.3f} s "
                      f"{one.tokens / one.last_s:6.1f} tok/s", flush=True)
    finally:
        proc.stop()
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=api.CHAT_MAX_TOKENS)
    p.add_argument("--before", type=Path, help="a checkout's src/ to run first as "
                   "'before' (PYTHONPATH), alternated with this one --repeat times")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("api_args", nargs="*", help="more `spececd api` arguments")
    args = p.parse_args()
    variants = ({"before": {"PYTHONPATH": str(args.before),
                            "SPECECD_MODELS": str(models_dir())}} if args.before else {})
    variants["after" if args.before else "this"] = {}
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, env in variants.items():
            print(f"== {name}")
            runs[name].append(measure(env, args))
    for name, measured in runs.items():
        first = {k: statistics.median(r[k][0] for r in measured) for k in measured[0]}
        later = {k: statistics.median(x for r in measured for x in r[k][1:] or r[k])
                 for k in measured[0]}
        print(f"{name}: first request " + ", ".join(f"{k} {v:.1f}" for k, v in first.items())
              + " tok/s; after the first " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                      later.items())
              + f" tok/s; constrained / plain {later['json_schema'] / later['plain']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
