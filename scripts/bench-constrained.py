"""Constrained against unconstrained output through `spececd api`, one request at a time
(issue 39: 9.4 against 31 tokens/s on a busy machine). Starts ``spececd api`` as a newcomer
does (the default pair in one process; ``--draft-model``/``--server`` pass through), then
alternates a plain chat request and the same request under a JSON schema, ``--rounds``
times, greedy. Prints each request's tokens/s (the first of each kind apart: it is where
a compile or any first-use cost shows) and the medians; the ratio is the figure to watch.

    python scripts/bench-constrained.py --rounds 8
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("api_args", nargs="*", help="more `spececd api` arguments")
    args = p.parse_args()
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spececd", "api", "--port", str(port),
                             *args.api_args], stderr=subprocess.PIPE, text=True)
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
    print("first request: " + ", ".join(f"{k} {v[0]:.1f} tok/s" for k, v in rates.items()))
    medians = {kind: statistics.median(v[1:] or v) for kind, v in rates.items()}
    print("median after the first: " + ", ".join(f"{k} {v:.1f} tok/s"
                                                 for k, v in medians.items()))
    print(f"constrained / plain: {medians['json_schema'] / medians['plain']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
