"""`spececd bench` and `spececd bench load` end to end on tiny models: they run, write every
output, and their figures hang together. (Speed itself is measured by running them, never
asserted in tests.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spececd", *args], capture_output=True,
                          text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def bench_load(tiny_models: dict[str, Path], out: Path, *args: str
               ) -> subprocess.CompletedProcess[str]:
    """`spececd bench load` with the tiny pair, 2 prompts of 16 tokens, into ``out``."""
    return run("bench", "load", "--draft-model", str(tiny_models["draft"]), "--target-model",
               str(tiny_models["llama"]), "--num-prompts", "2", "--max-tokens", "16",
               "--out", str(out), *args)


def test_bench_writes_every_output(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """At one RTT: a sweep runs the same configurations again at each RTT, through the same
    loop (at two RTTs this was the default suite's longest test, 239 s in a loaded run)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n---\nclass A:\n")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}))
    result = run("bench", "--draft-model", str(tiny_models["draft"]), "--target-model",
                 str(tiny_models["llama"]), "--prompts-file", str(prompts), "--iterations",
                 "1", "--max-tokens", "8", "--rtt-ms", "10", "--k", "2,auto",
                 "--proactive", "off,auto",  # auto runs rounds and streams (block-ahead too)
                 "--json-schema", str(schema), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    for name in ("bench.json", "bench.csv", "bench.md", "speedup_vs_rtt.png",
                 "acceptance_by_position.png", "tokens_per_s.png"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "bench.json").read_text())["summary"]
    kinds = {row["kind"] for row in summary}
    assert kinds == {"target", "assisted", "cloud", "spececd", "alone"}
    # Under the schema: the target alone, and at the RTT cloud-only and the first k and
    # setting (k=2, plain) drafting under the schema and unconstrained, each against the
    # baselines under the same schema.
    constrained = [row for row in summary if row["constraint"]]
    assert sorted((r["kind"], r["rtt_ms"], r["constrained_drafting"]) for r in constrained
                  ) == sorted([("alone", None, None)] + [
                      (kind, 10, drafting)
                      for kind, drafting in (("cloud", None), ("spececd", True),
                                             ("spececd", False))])
    alone = next(r for r in constrained if r["kind"] == "alone")["tokens_per_s"]
    cloud = {r["rtt_ms"]: r["tokens_per_s"] for r in constrained if r["kind"] == "cloud"}
    for row in constrained:
        if row["kind"] == "spececd":
            assert row["k"] == 2 and row["proactive"] == "off"
            # the opening brace and the first key are forced; unconstrained, nothing is
            assert (row["forced_per_round"] > 0) == row["constrained_drafting"]
            # against the baselines under the same schema, not the unconstrained ones
            assert row["speedup_vs_target"] == pytest.approx(row["tokens_per_s"] / alone,
                                                             rel=0.01, abs=0.002)
            assert row["speedup_vs_cloud"] == pytest.approx(
                row["tokens_per_s"] / cloud[row["rtt_ms"]], rel=0.01, abs=0.002)
    assert "| configuration | tokens/s | × target (schema) | × cloud-only (schema) |" in (
        out / "bench.md").read_text()
    spec = [row for row in summary if row["kind"] == "spececd" and not row["constraint"]]
    # k=2 plain, k=auto plain and auto
    assert len(spec) == 3
    for row in spec:
        assert row["label"] in ("EXCELLENT", "GOOD", "MODERATE", "POOR")
        assert 0 <= row["acceptance_rate"] <= 1 and row["bytes_per_token"] > 0
        if row["proactive"] in ("stream", "auto"):
            assert "bound" not in row  # another loop (at times): the bound does not apply
            assert ("auto_stream_share" in row) == ("auto_plain_share" in row) == (
                row["proactive"] == "auto")
        else:
            assert row["bound"] > 0 and row["c"] > 0 and row["v"] > 0
            # the bare forward of the same positions per pass, and the server's v over it
            assert row["bare_v"] > 0 and row["tax"] == pytest.approx(
                row["v"] / row["bare_v"], rel=0.01)
            if row["k"] == 2:  # two drafted tokens and the bonus position at most
                assert 1 <= row["positions_per_pass"] <= 3
        budget = row["budget_us"]  # the server's metrics, read for this configuration
        assert budget["forward"] > 0 and budget["processing"] > 0 and budget["queue"] >= 0
        assert ("edge_draft" in budget) == (row["proactive"] not in ("stream", "auto"))
    assert all(row["tax"] > 0 for row in summary if row["kind"] == "cloud")
    assert "bare" not in kinds  # the bare forward is a measurement, not a row
    markdown = (out / "bench.md").read_text()
    assert "| configuration | positions/pass | v | bare v | tax |" in markdown
    assert "Per-pass budget in microseconds" in markdown
    rtt10 = next(r for r in summary if r["kind"] == "cloud" and r["rtt_ms"] == 10)
    assert rtt10["ttft_ms"] >= 10  # one emulated round trip before the first token


def test_bench_load_reports_a_curve(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    result = bench_load(tiny_models, tmp_path, "--clients", "1,3", "--duration", "2",
                        "--warmup-s", "0.5", "--acceptance", "0.9", "--kind",
                        "replay,replay-stream,cloud-only")
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "load.json").read_text())["rows"]
    assert [(r["clients"], r["kind"]) for r in rows] == [
        (1, "replay"), (1, "replay-stream"), (1, "cloud-only"),
        (3, "replay"), (3, "replay-stream"), (3, "cloud-only")]
    for r in rows:
        assert r["tokens"] > 0 and r["round_latency_ms"]["p50"] > 0
        assert r["engine"] == "builtin" and r["token_latency_ms"]["p50"] > 0
        # 16 tokens a generation: several begin in the window, each with its first token
        assert r["generations"] > 0 and r["ttft_ms"]["p50"] > 0
        assert r["arrival"] == "all" and r["duration_s"] == 2 and "steady" in r
    replay = [r for r in rows if r["kind"] == "replay"]
    cloud = [r for r in rows if r["kind"] == "cloud-only"]
    # Cloud-only needs one pass per token (less when batched); replay at acceptance 0.9
    # gains several tokens per pass.
    assert all(r["passes_per_token"] < 0.5 for r in replay)
    assert cloud[0]["passes_per_token"] == pytest.approx(1.0, abs=0.01)
    for name in ("load_curve.png", "load.md", "load.csv"):
        assert (tmp_path / name).is_file(), name
    # Replay's acceptance as measured: near the 0.9 it replays at, greedy
    assert all(0.6 < r["acceptance"] <= 1 for r in replay)
    assert all(r["acceptance"] is None for r in cloud)


@pytest.mark.slow  # a server of its own, for plumbing the load test above runs greedy
def test_bench_load_samples_at_a_temperature(tiny_models: dict[str, Path],
                                             tmp_path: Path) -> None:
    result = bench_load(tiny_models, tmp_path, "--clients", "2", "--duration", "1",
                        "--kind", "replay,cloud-only", "--temperature", "1.5")
    assert result.returncode == 0, result.stderr
    load = json.loads((tmp_path / "load.json").read_text())
    assert load["meta"]["temperature"] == 1.5
    replay, cloud = load["rows"]
    assert replay["temperature"] == cloud["temperature"] == 1.5
    # Each client replays (at 0.8) the target's own sampled continuation for its seed,
    # which the built-in engine draws again position by position: kept as greedy is.
    assert 0.4 < replay["acceptance"] <= 1 and replay["tokens"] > 0
    assert "temperature 1.5" in (tmp_path / "load.md").read_text()
