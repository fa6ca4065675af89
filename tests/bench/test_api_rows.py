"""The rows measured through `spececd api` (issue 39's concurrent clients and constrained
against unconstrained chat, and Predicted Outputs' code edits) as bench rows: their names,
their figures in the report, the client's counting and requests against a scripted
server; and a report without matplotlib."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from spececd.bench import api, load_report, report
from spececd.bench.runner import api_plan, edit_plan, name, save

META = {"draft": "d", "target": "t", "backend": "hf", "transport": "websocket",
        "mode": "exact", "temperature": 0.0, "max_tokens": 8, "num_prompts": 1,
        "iterations": 1, "seed": 0, "rtt_ms": [0.0], "jitter_ms": 0.0,
        "machine": {"cpus": 2}, "started": "now", "duration_s": 1.0,
        "api": {"requests": 24, "input_len": 32, "output_len": 48, "concurrency": 4,
                "chat_requests": 4, "chat_max_tokens": 64}}


def raw() -> dict[str, Any]:
    """The target alone at 10 tokens/s and the API rows, as a run records them."""
    configs = {"target alone": {"kind": "target", "target": "t", "passes": [[
        {"tokens": 10, "wall_s": 1.0, "ttft_s": 0.1}]], "server": []}}
    figures = {"api_concurrent": {"tokens": 96, "wall_s": 2.0, "ttft_s": 0.12,
                                  "tpot_s": 0.02},
               False: {"tokens": 64, "wall_s": 0.5, "ttft_s": 0.03},
               True: {"tokens": 20, "wall_s": 0.25, "ttft_s": 0.02}}
    for entry in api_plan():
        key = entry["kind"] if entry["kind"] == "api_concurrent" else entry["api_constrained"]
        configs[name(entry)] = {**entry, "passes": [[figures[key]]], "server": []}
    return {"meta": META, "configs": configs}


def test_each_api_row_has_a_name_of_its_own() -> None:
    assert [name(entry) for entry in api_plan()] == [
        "OpenAI API ×4 concurrent, two-process", "OpenAI API ×4 concurrent, in-process",
        "OpenAI API chat, unconstrained", "OpenAI API chat · JSON schema"]
    # each setup's rows go to the worker that started that setup
    assert {e["worker"] for e in api_plan()} == {f"api-{s}" for s in api.SETUPS}


def test_the_report_gives_the_api_rows_their_own_figures() -> None:
    rows = {r["config"]: r for r in report.summarise(raw())}
    two = rows["OpenAI API ×4 concurrent, two-process"]
    assert (two["tokens_per_s"], two["ttft_ms"], two["tpot_ms"]) == (48.0, 120.0, 20.0)
    assert two["setup"] == "two-process"
    # other requests than the baselines': no speedup against the target alone
    assert all(r["speedup_vs_target"] is None for c, r in rows.items() if "API" in c)
    assert rows["target alone"]["speedup_vs_target"] == 1
    markdown = report.to_markdown(list(rows.values()), META)
    assert "| OpenAI API chat · JSON schema | 80 (80–80) | 20 | – |" in markdown
    assert "Constrained over unconstrained chat: 0.62" in markdown  # 80 / 128
    assert "tpot_ms" in report.to_csv(list(rows.values())).splitlines()[0]


def test_the_code_edit_rows_are_named_by_source_and_set_against_cloud_only() -> None:
    plan = edit_plan("edits.json")
    assert [name(entry) for entry in plan] == [
        "OpenAI API code edits, prediction", "OpenAI API code edits, lookup",
        "OpenAI API code edits, model", "OpenAI API code edits, cloud-only"]
    assert {e["worker"] for e in plan} == {"api-two-process"} and edit_plan(None) == []
    speeds = {"prediction": 60, "lookup": 30, "model": 40, "cloud-only": 20}  # tokens in 1 s
    configs = {name(e): {**e, "passes": [[{"tokens": speeds[e["edit_source"]],
                                             "wall_s": 1.0, "ttft_s": 0.05}]], "server": []}
               for e in plan}
    rows = {r["config"]: r for r in report.summarise({"meta": META, "configs": configs})}
    assert rows["OpenAI API code edits, prediction"]["speedup_vs_cloud"] == 3.0
    assert rows["OpenAI API code edits, cloud-only"]["speedup_vs_cloud"] == 1.0
    markdown = report.to_markdown(list(rows.values()), META)
    assert "| OpenAI API code edits, model | 40 (40–40) | 2 | 50 |" in markdown
    assert "Through `spececd api`, started as a user starts it" not in markdown


class Scripted(BaseHTTPRequestHandler):
    """An API streaming three events of SpecECD's (2, 1 and 2 tokens) 20 ms apart."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 5
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        generated = 0
        for ids in ([1, 2], [3], [4, 5]):
            time.sleep(0.02)
            generated += len(ids)
            event = {"choices": [{"text": "x", "spececd": {
                "token_ids": ids, "generated": generated}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class Recorded(BaseHTTPRequestHandler):
    """An API that records each body and streams one event of 3 tokens."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        event = {"choices": [{"text": "x", "spececd": {"token_ids": [1, 2, 3],
                                                      "generated": 3}}]}
        self.wfile.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: Any) -> None:
        pass


def test_each_code_edit_row_asks_for_its_source_of_drafts() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    item = {"prompt": "def f(a):", "original": "def f(a):\n    return a\n", "max_tokens": 9}
    try:
        for source in api.EDIT_SOURCES:
            assert api.edit(url, item, source).tokens == 3
    finally:
        server.shutdown()
    prediction, lookup, model, cloud = Recorded.bodies
    assert all(b["prompt"] == "def f(a):" and b["max_tokens"] == 9 and b["temperature"] == 0
               for b in Recorded.bodies)
    assert prediction["prediction"] == {"type": "content", "content": item["original"]}
    assert "draft_source" not in prediction  # the API's own source where it leaves it
    assert (lookup["draft_source"], model["draft_source"]) == ("lookup", "model")
    assert cloud["cloud_only"] is True
    assert not {"prediction"} & (set(lookup) | set(model) | set(cloud))


def test_the_concurrent_client_counts_what_the_api_streamed(scripted: str) -> None:
    ticks: list[None] = []
    figures = api.concurrent(scripted, api.random_prompts(0, count=6), max_tokens=5,
                             concurrency=2, progress=lambda: ticks.append(None))
    assert figures["tokens"] == 30 and len(ticks) == 6
    assert figures["output_throughput"] == pytest.approx(30 / figures["wall_s"])
    # the first token after one 20 ms wait; four more tokens over two more waits
    assert 15 <= figures["median_ttft_ms"] < 200
    assert 7 <= figures["median_tpot_ms"] < 60


def test_without_matplotlib_the_figures_are_written_and_the_plots_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with caplog.at_level(logging.WARNING, logger="spececd.bench"):
        written = save(raw(), tmp_path)
        drawn = report.draw(load_report.plot, [], tmp_path / "load_curve.png")
    assert written == ["bench.json", "bench.csv", "bench.md"] and not drawn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.csv", "bench.json",
                                                          "bench.md"]
    assert "OpenAI API chat" in (tmp_path / "bench.md").read_text()
    skipped = [r.getMessage() for r in caplog.records if "plots skipped" in r.getMessage()]
    assert len(skipped) == 2 and "pip install matplotlib" in skipped[0]
