"""`spececd bench load`'s measured window, on clients that run no model and no server:
what falls in the window and what does not, time to first token apart from the rounds of
sessions already decoding, the steady-state flag, staggered arrivals, and one server per
token budget with every row run on each in turn. (The real clients and server: the slow
tests/bench/test_bench_cli.py::test_bench_load_reports_a_curve.)"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spececd.bench import load, load_report
from spececd.bench.processes import server_command
from spececd.bench.runner import BenchConfig
from spececd.bench.window import ClientResult, Window, window_figures
from spececd.cli import bench as bench_cli
from spececd.cli import build_parser
from spececd.errors import InputError


def outputs(start: float, end: float, step: float = 0.1, tokens: int = 4,
            every: int = 10) -> ClientResult:
    """A client with an output of ``tokens`` every ``step`` seconds from ``start`` to
    ``end``, each ``every``-th the first of a generation (after 0.3 s)."""
    result = ClientResult()
    for i in range(round((end - start) / step)):
        first = i % every == 0
        result.record(start + i * step, 0.3 if first else step, tokens, first)
    return result


def test_the_window_keeps_first_tokens_apart_and_leaves_out_what_fell_outside() -> None:
    client = outputs(100.0, 110.0)
    client.events[:0] = [(99.0, 12.0, 1, True)]  # the first prompt, prefilled in a crowd
    client.record(110.5, 5.0, 4, False)  # a round that ended after the window closed
    figures = window_figures([client], 100.0, 110.0, max_tokens=8, joined=1)
    assert figures["tokens"] == 100 * 4 and figures["server_tokens_per_s"] == 40.0
    assert figures["generations"] == 10
    assert figures["ttft_ms"] == {"p50": 300.0, "p95": 300.0, "p99": 300.0}
    # the rounds of sessions already decoding: no first token among them
    assert figures["round_latency_ms"] == {"p50": 100.0, "p95": 100.0, "p99": 100.0}
    assert figures["token_latency_ms"]["p99"] == 25.0
    assert figures["steady"] and figures["steady_note"] is None


def test_a_window_that_is_not_steady_says_why() -> None:
    steady = [outputs(0.0, 20.0), outputs(0.05, 20.0)]
    assert window_figures(steady, 0.0, 20.0, max_tokens=64, joined=2)["steady"]
    # the second half slower than the first by more than STEADY_SPREAD
    slowing = [outputs(0.0, 10.0), outputs(10.0, 20.0, step=0.2)]
    figures = window_figures(slowing, 0.0, 20.0, max_tokens=64, joined=2)
    assert not figures["steady"] and "halves" in figures["steady_note"]
    assert figures["halves_tokens_per_s"] == [40.0, 20.0]
    # a client still waiting for its first token when the window opened
    figures = window_figures(steady, 0.0, 20.0, max_tokens=64, joined=1)
    assert figures["steady_note"] == "1 of 2 clients had no first token before the window"
    # fewer tokens than a whole generation per client: the next prompts' prefill unseen
    figures = window_figures(steady, 0.0, 20.0, max_tokens=1000, joined=2)
    assert not figures["steady"] and "under a generation per client" in figures[
        "steady_note"]


def test_clients_join_over_the_ramp_and_are_measured_after_they_all_have(
        monkeypatch: pytest.MonkeyPatch) -> None:
    starts: dict[int, float] = {}
    offsets: dict[int, float] = {}

    def drive(url: str, drafter: Any, fingerprint: Any, prompt: list[int], k: int,
              max_tokens: int, cloud_only: bool, window: Window, offset: float, seed: int,
              *rest: Any) -> ClientResult:
        result = ClientResult()
        window.ready()
        window.wait_start(offset)
        starts[seed], offsets[seed] = time.monotonic(), offset
        while (now := time.monotonic()) < window.closes:
            if not result.events:
                window.join()
            result.record(now, 0.01, 2, not result.events)
            time.sleep(0.01)
        return result

    monkeypatch.setattr(load, "drive", drive)
    monkeypatch.setattr(load, "metrics", lambda *urls: {})
    began = time.monotonic()
    row = load.run_load("ws://x", None, [[1]], 3, 0.5, "cloud-only",  # type: ignore[arg-type]
                        warmup_s=0.2, ramp_s=0.6)
    # client i of 3 starts i x 0.2 s in (give or take a thread's wake-up); the window waits
    # for the last one, then warms up
    assert offsets == pytest.approx({0: 0.0, 1: 0.2, 2: 0.4})
    assert starts[2] - starts[0] >= 0.25
    assert row["arrival"] == "stagger" and row["join_s"] >= 0.39
    assert time.monotonic() - began >= 0.39 + 0.2 + 0.5
    assert row["tokens"] > 0 and row["generations"] == 0 and row["ttft_ms"] is None
    assert row["server_tokens_per_s"] == pytest.approx(row["tokens"] / 0.5)
    assert load.run_load("ws://x", None, [[1]], 2, 0.2, "cloud-only",  # type: ignore[arg-type]
                         warmup_s=0.0)["arrival"] == "all"


def test_rows_run_on_each_server_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load, "run_load", lambda url, fp, prompts, n, duration, kind, *rest,
                        warmup_s, ramp_s: {"clients": n, "url": url, "ramp_s": ramp_s})
    servers = [("ws://a", {"token_budget": "auto"}), ("ws://b", {"token_budget": "off"})]
    rows = load.run_curve(servers, None, [[1]], [1, 4], 1.0,  # type: ignore[arg-type]
                          ["cloud-only"], 0.8, 4, 8, None, arrivals=["all", "stagger"],
                          ramp_s=7.0)
    assert [(r["clients"], r["ramp_s"], r["url"], r["token_budget"]) for r in rows] == [
        (n, ramp, url, budget) for n in (1, 4) for ramp in (0.0, 7.0)
        for url, budget in (("ws://a", "auto"), ("ws://b", "off"))]


def test_the_server_gets_the_token_budget_only_when_given() -> None:
    plan = BenchConfig(draft="d", target="t", prompts=[])
    assert "--token-budget" not in server_command(plan)
    command = server_command(BenchConfig(draft="d", target="t", prompts=[],
                                         token_budget="auto"))
    assert command[command.index("--token-budget") + 1] == "auto"


def row(clients: int, kind: str, tokens_per_s: float, **more: Any) -> dict[str, Any]:
    return {"clients": clients, "kind": kind, "server_tokens_per_s": tokens_per_s,
            "client_tokens_per_s": tokens_per_s / clients, "passes_per_token": 1.0,
            "mean_batch": 1.0, "arrival": "all", "ramp_s": 0.0, "steady": True, **more}


def test_bench_load_starts_a_server_for_each_token_budget(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from spececd.backends import base, registry
    from spececd.bench import processes

    started: list[BenchConfig] = []
    stopped: list[int] = []

    class Server:
        def __init__(self, port: int) -> None:
            self.port = port

        def terminate(self) -> None:
            stopped.append(self.port)

        def wait(self, timeout: float) -> int:
            return 0

    def start_server(cfg: BenchConfig) -> tuple[Server, dict[str, int]]:
        started.append(cfg)
        return Server(len(started)), {"websocket": len(started)}

    curves: list[list[tuple[str, dict[str, Any]]]] = []

    def run_curve(servers: list[tuple[str, dict[str, Any]]], *args: Any, **kw: Any
                  ) -> list[dict[str, Any]]:
        curves.append(servers)
        return [row(1, kind, speed, **tags) for _, tags in servers
                for kind, speed in (("cloud-only", 10.0), ("lookup", 15.0))]

    monkeypatch.setattr(processes, "start_server", start_server)
    monkeypatch.setattr(processes, "resolved_dtype", lambda dtype, device, model: "float32")
    monkeypatch.setattr(load, "run_curve", run_curve)
    monkeypatch.setattr(registry, "load_backend", lambda *a, **kw: SimpleNamespace(
        tokenizer=SimpleNamespace(encode=lambda text: [1, 2]), vocab_size=8))
    monkeypatch.setattr(base, "tokenizer_fingerprint", lambda *a: None)
    monkeypatch.setattr("spececd.bench.report.draw", lambda *a: False)
    argv = ["bench", "load", "--clients", "1", "--kind", "cloud-only,lookup",
            "--out", str(tmp_path)]
    assert bench_cli.run(build_parser().parse_args([*argv, "--token-budget", "auto,off"])
                         ) == 0
    assert [cfg.token_budget for cfg in started] == ["auto", "off"]
    assert curves == [[("ws://127.0.0.1:1", {"engine": "builtin", "token_budget": "auto"}),
                       ("ws://127.0.0.1:2", {"engine": "builtin", "token_budget": "off"})]]
    assert sorted(stopped) == [1, 2]
    rows = json.loads((tmp_path / "load.json").read_text())["rows"]
    assert [r["token_budget"] for r in rows] == ["auto", "auto", "off", "off"]
    table = (tmp_path / "load.md").read_text()
    assert "| 1 | builtin, budget off | lookup | all | 15.0 |" in table
    assert "1,builtin,off,lookup,,,all,0.0," in (tmp_path / "load.csv").read_text()
    # without the option: one server, not told of a budget (its own default)
    started.clear()
    assert bench_cli.run(build_parser().parse_args(argv)) == 0
    assert [cfg.token_budget for cfg in started] == [None]
    with pytest.raises(InputError, match="--token-budget is for the servers started here"):
        bench_cli.run(build_parser().parse_args([*argv, "--server", "ws://h:1",
                                                 "--token-budget", "auto"]))


def test_the_ratio_is_against_cloud_only_on_the_same_budget_and_arrival() -> None:
    rows = [row(4, "cloud-only", 10.0, token_budget="auto"),
            row(4, "cloud-only", 20.0, token_budget="off"),
            row(4, "lookup", 30.0, token_budget="auto"),
            row(4, "lookup", 30.0, token_budget="off"),
            row(4, "lookup", 30.0, token_budget="off", arrival="stagger", ramp_s=5.0)]
    assert load_report.ratios(rows) == [None, None, 3.0, 1.5, None]
    csv = load_report.to_csv(rows).splitlines()
    header = csv[0].split(",")
    assert header[header.index("x_cloud_only")] == "x_cloud_only"
    assert [line.split(",")[header.index("x_cloud_only")] for line in csv[1:]] == [
        "", "", "3.0", "1.5", ""]


def test_the_curve_is_drawn_when_no_window_saw_a_first_token(tmp_path: Path) -> None:
    """Generations longer than the window (64 clients, 384 tokens each, 30 s) leave no
    time to first token to plot; the figure is still drawn (a log scale over nothing
    stopped the run after its table, in matplotlib's layout)."""
    pytest.importorskip("matplotlib")
    rows = [row(64, "cloud-only", 336.0, round_latency_ms={"p50": 185.9, "p99": 422.3},
                ttft_ms=None)]
    load_report.plot(rows, tmp_path / "load_curve.png")
    assert (tmp_path / "load_curve.png").stat().st_size > 0
