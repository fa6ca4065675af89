"""Constrained against unconstrained output through `spececd api`, one request at a time
(issue 39: 9.4 against 31 tokens/s on a busy machine). Starts ``spececd api`` as a newcomer
does (the default pair in one process; ``--draft-model``/``--server`` pass through), then
alternates a plain chat request and the same request under a JSON schema, ``--rounds``
times, greedy. Prints each request's tokens/s (the first of each kind apart: it is where
a compile or any first-use cost shows) and the medians; the ratio is the figure to watch.

    python scripts/bench-constrained.py --rounds 8
    python scripts/bench-constrained.py --before /tmp/old/src --repeat 2  # side by side
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.server import free_port  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "tags"]}


def measure(env: dict[str, str], args: argparse.Namespace) -> dict[str, list[float]]:
    """One ``spececd api``'s tokens/s per request, plain and constrained alternated."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spececd", "api", "--port", str(port),
                             *args.api_args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    assert proc.stderr is not None
    for line in proc.stderr:
        if "serving" in line:
            print(line.strip())
            break
    else:
        raise SystemExit("spececd api did not start")
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    messages = [{"role": "user", "content": "Jason is 25 years old and likes tea."}]
    kinds = {"plain": {"ignore_eos": True},
             "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
                 "name": "person", "schema": SCHEMA}}}}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        with httpx.Client(timeout=300) as client:
            for round_ in range(args.rounds):
                for kind, extra in kinds.items():
                    began = time.perf_counter()
                    reply = client.post(url, json={
                        "model": "spececd", "messages": messages, "temperature": 0,
                        "max_tokens": args.max_tokens, **extra}).json()
                    took = time.perf_counter() - began
                    tokens = reply["usage"]["completion_tokens"]
                    rates[kind].append(tokens / took)
                    print(f"{round_} {kind:11s} {tokens:3d} tokens {took:6.3f} s "
                          f"{tokens / took:6.1f} tok/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--before", type=Path, help="a checkout's src/ to run first as "
                   "'before' (PYTHONPATH), alternated with this one --repeat times")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("api_args", nargs="*", help="more `spececd api` arguments")
    args = p.parse_args()
    variants = ({"before": {"PYTHONPATH": str(args.before),
                            "SPECECD_MODELS": str(REPO / "models")}} if args.before else {})
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
