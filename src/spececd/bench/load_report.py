"""`spececd bench load`'s rows as a Markdown table, CSV and a plot: each row's ratio
against cloud-only on the same engine and token budget with its clients arriving the same
way, the latencies of the measured window (:mod:`spececd.bench.window`), and the rows whose
window was not steady, flagged."""

from __future__ import annotations

import csv
import io
import math
from typing import Any


def engine_label(row: dict[str, Any]) -> str:
    """The engine a row's server ran (rows of older runs name none: the built-in one), with
    its token budget where the bench set one."""
    engine = str(row.get("engine", "builtin"))
    return engine + (f", budget {row['token_budget']}" if row.get("token_budget") else "")


def kind_label(row: dict[str, Any]) -> str:
    """A row's kind, with the acceptance replayed at and the temperature where they apply."""
    label = str(row["kind"]) + (f" (replaying at {row['acceptance_target']})"
                                if row.get("acceptance_target") is not None else "")
    if row.get("temperature"):
        label += f", temperature {row['temperature']:g}"
    return label


def arrival_label(row: dict[str, Any]) -> str:
    return (f"stagger {row['ramp_s']:g} s" if row.get("arrival") == "stagger"
            else str(row.get("arrival", "all")))


def ratios(rows: list[dict[str, Any]]) -> list[float | None]:
    """Each row's server tokens/s over cloud-only's on the same engine and budget, with as
    many clients arriving the same way (None: cloud-only itself, or no such row)."""
    def key(r: dict[str, Any]) -> tuple[str, int, str]:
        return engine_label(r), r["clients"], arrival_label(r)

    baseline = {key(r): r["server_tokens_per_s"] for r in rows if r["kind"] == "cloud-only"}
    return [round(r["server_tokens_per_s"] / base, 2)
            if r["kind"] != "cloud-only" and (base := baseline.get(key(r))) else None
            for r in rows]


def _ms(figures: dict[str, float] | None) -> str:
    return " / ".join(f"{figures[p]:g}" for p in ("p50", "p95", "p99")) if figures else "–"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row; each row's ratio is against cloud-only on the same engine and
    budget, its clients arriving the same way. The latencies are of the measured window:
    time to first token of the generations begun in it, and the rounds (cloud-only: the
    tokens) of sessions already decoding."""
    lines = ["| clients | engine | kind | arrival | server tokens/s | per client | "
             "× cloud-only | acceptance | TTFT ms p50 / p95 / p99 | "
             "round ms p50 / p95 / p99 | ms per token p50 / p95 / p99 | passes/token | "
             "mean batch | steady |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, ratio in zip(rows, ratios(rows), strict=True):
        steady = r.get("steady")
        lines.append(f"| {r['clients']} | {engine_label(r)} | {kind_label(r)} | "
                     f"{arrival_label(r)} | "
                     f"{r['server_tokens_per_s']} | {r['client_tokens_per_s']} | "
                     f"{ratio if ratio is not None else '–'} | "
                     f"{r.get('acceptance') if r.get('acceptance') is not None else '–'} | "
                     f"{_ms(r.get('ttft_ms'))} | {_ms(r.get('round_latency_ms'))} | "
                     f"{_ms(r.get('token_latency_ms'))} | "
                     f"{r['passes_per_token']} | {r['mean_batch']} | "
                     f"{'–' if steady is None else 'yes' if steady else 'NO'} |")
    unsteady = [r for r in rows if r.get("steady") is False]
    if unsteady:
        lines += ["", "Not steady (lengthen `--duration` or `--warmup-s`):", ""]
        lines += [f"- {r['clients']} {kind_label(r)}, {engine_label(r)}, {arrival_label(r)}: "
                  f"{r['steady_note']}" for r in unsteady]
    return "\n".join(lines) + "\n"


CSV_COLUMNS = ["clients", "engine", "token_budget", "kind", "acceptance_target",
               "temperature", "arrival", "ramp_s", "warmup_s", "duration_s", "join_s",
               "server_tokens_per_s", "client_tokens_per_s", "x_cloud_only", "acceptance",
               "passes_per_token", "mean_batch", "generations", "tokens", "steady",
               "steady_note"]
LATENCIES = ("ttft_ms", "round_latency_ms", "token_latency_ms")


def to_csv(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV: one column per figure, each latency's p50, p95 and p99 apart."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CSV_COLUMNS + [f"{name}_{p}" for name in LATENCIES
                                   for p in ("p50", "p95", "p99")])
    for r, ratio in zip(rows, ratios(rows), strict=True):
        values = {**r, "x_cloud_only": ratio}
        writer.writerow([_csv_cell(values.get(c)) for c in CSV_COLUMNS]
                        + [_csv_cell((r.get(name) or {}).get(p)) for name in LATENCIES
                           for p in ("p50", "p95", "p99")])
    return buffer.getvalue()


def _csv_cell(value: Any) -> Any:
    return "" if value is None else value


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    """Server tokens/s, the round latency of sessions decoding and time to first token
    (p50 solid, p99 dashed) against clients: one line per engine and budget, kind and
    arrival."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    lines = dict.fromkeys((engine_label(r), kind_label(r), arrival_label(r)) for r in rows)
    named = [len({line[i] for line in lines}) > 1 for i in range(3)]
    logged: set[Any] = set()
    for line in lines:
        points = sorted((r["clients"], r) for r in rows
                        if (engine_label(r), kind_label(r), arrival_label(r)) == line)
        name = ", ".join(part for part, shown in zip(line, named, strict=True)
                         if shown or part == line[1])
        x = [n for n, _ in points]
        drawn = axes[0].plot(x, [r["server_tokens_per_s"] for _, r in points], marker="o",
                             label=name)
        for ax, figure in zip(axes[1:], ("round_latency_ms", "ttft_ms"), strict=True):
            for p, style in (("p50", "-"), ("p99", "--")):
                values = [(r.get(figure) or {}).get(p, math.nan) for _, r in points]
                ax.plot(x, values, style, marker="o", color=drawn[0].get_color())
                if any(v > 0 for v in values):  # NaN > 0 is False
                    logged.add(ax)
    for ax, label in zip(axes, ("server tokens/s", "round ms of sessions decoding "
                                "(p50 solid, p99 dashed)",
                                "time to first token ms (p50 solid, p99 dashed)"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in logged:  # an axis with nothing to show (no first token in any window) stays
        ax.set_yscale("log")  # linear: matplotlib cannot log-scale it
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
