"""The bench report's spread of each setting against cloud-only: pass by pass (each pass
against cloud-only's pass of the same iteration), and `auto` beside the settings it
chooses between."""

from __future__ import annotations

from typing import Any

import pytest

from spececd.bench import report
from spececd.bench.runner import name

META = {"draft": "d", "target": "t", "backend": "hf", "transport": "websocket",
        "mode": "exact", "temperature": 0.0, "max_tokens": 8, "num_prompts": 1,
        "iterations": 3, "seed": 0, "rtt_ms": [20.0], "jitter_ms": 0.0,
        "machine": {"cpus": 2}, "started": "now", "duration_s": 1.0}


def passes(*speeds: float) -> list[list[dict[str, Any]]]:
    """One pass per speed, of one prompt: 60 tokens at that many tokens per second."""
    return [[{"tokens": 60, "wall_s": 60 / speed, "ttft_s": 0.1,
              "stats": {"generated": 60, "drafted": 40, "accepted": 30, "rounds": 10}}]
            for speed in speeds]


def raw() -> dict[str, Any]:
    """At RTT 20: cloud-only slowed by load in its second pass, and the settings beside it
    (auto slowed in its third)."""
    speeds = {None: (100.0, 50.0, 100.0), "off": (90.0, 45.0, 95.0),
              "stream": (130.0, 70.0, 120.0), "auto": (125.0, 66.0, 60.0)}
    configs = {}
    for proactive, measured in speeds.items():
        entry: dict[str, Any] = {"kind": "cloud" if proactive is None else "spececd",
                                 "rtt_ms": 20.0, "target": "t"}
        if proactive is not None:
            entry |= {"k": "auto", "proactive": proactive}
        configs[name(entry)] = {**entry, "passes": passes(*measured), "server": []}
    return {"meta": META, "configs": configs}


def test_each_setting_has_its_ratio_to_cloud_only_pass_by_pass() -> None:
    rows = {r["config"]: r for r in report.summarise(raw())}
    auto = rows["SpecECD k=auto auto @ RTT 20 ms"]
    # 125/100, 66/50 and 60/100: the third pass, slowed alone, shows as the minimum
    assert auto["speedup_vs_cloud_passes"] == [1.25, 1.32, 0.6]
    assert (auto["speedup_vs_cloud_min"], auto["speedup_vs_cloud_max"]) == (0.6, 1.32)
    assert auto["speedup_vs_cloud"] == pytest.approx(66 / 100)  # medians: 66 over 100
    stream = rows["SpecECD k=auto stream @ RTT 20 ms"]
    assert (stream["speedup_vs_cloud_min"], stream["speedup_vs_cloud_max"]) == (1.2, 1.4)
    cloud = rows["cloud-only @ RTT 20 ms"]
    assert cloud["speedup_vs_cloud_min"] == cloud["speedup_vs_cloud_max"] == 1
    csv_head = report.to_csv(list(rows.values())).splitlines()[0]
    assert "speedup_vs_cloud_min,speedup_vs_cloud_max" in csv_head


def test_the_markdown_sets_auto_beside_the_settings_it_chooses_between() -> None:
    markdown = report.to_markdown(report.summarise(raw()), META)
    assert "| SpecECD k=auto auto @ RTT 20 ms | 66 (60–125) | 0.66 | 0.66 (0.6–1.32) |" \
        in markdown
    # plain, block-ahead (not run), stream, auto, and auto over the best other median
    assert ("| SpecECD k=auto @ RTT 20 ms | 0.9 (0.9–0.95) | – | 1.2 (1.2–1.4) | "
            "**0.66 (0.6–1.32)** | 0.550 |") in markdown


def test_an_empty_pass_does_not_shift_the_pairing_with_cloud_only() -> None:
    # auto's second pass measured nothing (every generation failed, say): its third pass
    # is compared with cloud-only's third (100), not its second (50), and cloud-only's
    # own empty pass leaves the setting's pass of that iteration out.
    data = raw()
    configs = data["configs"]
    configs["SpecECD k=auto auto @ RTT 20 ms"]["passes"][1] = []
    configs["cloud-only @ RTT 20 ms"]["passes"][0] = []
    rows = {r["config"]: r for r in report.summarise(data)}
    assert rows["SpecECD k=auto auto @ RTT 20 ms"]["speedup_vs_cloud_passes"] == [0.6]
    assert rows["SpecECD k=auto stream @ RTT 20 ms"]["speedup_vs_cloud_passes"] == [1.4, 1.2]
