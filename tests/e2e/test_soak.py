"""Soak test (slow; run it yourself: pytest -m slow): 32 clients against one server for ten
minutes; resident memory grows less than 5% after warm-up, and no client sees an error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from spececd.backends.base import tokenizer_fingerprint
from spececd.backends.registry import load_backend
from spececd.bench import load
from tests.e2e.server import ServerProcess
from tests.reference import PROMPTS

MINUTES = float(os.environ.get("SPECECD_SOAK_MINUTES", "10"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_soak_32_clients(tiny_models: dict[str, Path]) -> None:
    proc = ServerProcess(tiny_models["llama"], "--max-sessions", "64")
    backend = load_backend(str(tiny_models["draft"]), device="cpu", dtype="float32")
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    prompts = [backend.tokenizer.encode(p) for p in PROMPTS]
    try:
        assert proc.proc is not None
        warm = load.run_load(proc.url, fingerprint, prompts, 32, 30, "replay", 0.8, 4, 64)
        baseline = rss_kib(proc.proc.pid)
        samples = []
        deadline = time.monotonic() + MINUTES * 60
        rows = []
        while time.monotonic() < deadline:
            rows.append(load.run_load(proc.url, fingerprint, prompts, 32, 60, "replay", 0.8,
                                      4, 64))
            samples.append(rss_kib(proc.proc.pid))
        status = proc.status()
    finally:
        proc.stop()
    growth = (max(samples) - baseline) / baseline
    print(f"soak: {MINUTES} min, RSS after warm-up {baseline} KiB, max {max(samples)} KiB "
          f"({growth:+.1%}), {sum(r['tokens'] for r in rows)} tokens, warm-up "
          f"{warm['server_tokens_per_s']} tokens/s, errors {status['errors']}")
    assert growth < 0.05
    assert not status["errors"]
    assert all(r["tokens"] > 0 for r in rows)
