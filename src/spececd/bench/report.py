"""Benchmark report: per-configuration figures, the Leviathan bound, JSON, CSV, Markdown
and PNG plots.

For a SpecECD configuration drafting ``k`` tokens per round:

- tokens per round ``E = (1 - alpha^(k+1)) / (1 - alpha)`` for Leviathan et al.'s alpha,
  the probability that a token is accepted *given that it is reached*. That is not the
  acceptance rate reported (accepted / drafted, which also counts tokens after a
  rejection), so E is taken as measured (accepted + own) / rounds (own: the rounds whose
  verifier token the output kept), and the report gives
  the alpha it implies (``alpha_iid``);
- ``c`` = one draft step / one target step (every draft step counts, also those drafted
  ahead and discarded); ``v`` = one verify pass / one target step,
  with the target step measured on the server (cloud-only passes, server-side time per
  token) and the draft step and verify pass from this configuration's own statistics;
- the bound on the speedup over the target alone, ``E / (k c + v)`` (Leviathan et al.
  2023, Theorem 3.8 with the verify cost made explicit), and achieved / bound, where
  achieved = tokens/s / the target alone's tokens/s.

The network is not in the bound: at RTT > 0 achieved/bound shows what the round trips cost.
For ``k=auto`` the bound is evaluated at the mean drafted length per round. Proactive
drafting overlaps drafting with the round trip, which the bound does not model: it can
beat the bound. Stream drafting (``proactive: stream``) is another loop altogether (the
server steps on its own and verifies hints when they are there), so its rows carry no
bound; their "rounds" are the server steps that verified a hint.

The rows measured through ``spececd api`` (``api_concurrent``, ``api_chat``, ``api_edit``:
:mod:`spececd.bench.api`) run their own requests, so they carry no speedup over the
target alone; ``bench.md`` gives them tables of their own, with TTFT, TPOT and constrained
over unconstrained, and the code edits (``api_edit``) against their own cloud-only row.

The plots need matplotlib; without it :func:`draw` logs that they were skipped and how
to get them, and everything else is written.
"""

from __future__ import annotations

import csv
import io
import logging
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# How the rows generated under a JSON schema are named (``spececd bench --json-schema``).
SCHEMA_TAG = " · JSON schema"
UNCONSTRAINED_TAG = ", unconstrained drafting"
_AT_RTT = re.compile(r" @ RTT [0-9.]+ ms")  # in a configuration's name
PLOTS = ("speedup_vs_rtt.png", "acceptance_by_position.png", "tokens_per_s.png")
API_KINDS = ("api_concurrent", "api_chat", "api_edit")  # measured through `spececd api`


def label(acceptance: float) -> str:
    """The SpecECD seed's assessment of an acceptance rate."""
    if acceptance > 0.5:
        return "EXCELLENT"
    if acceptance > 0.3:
        return "GOOD"
    if acceptance > 0.1:
        return "MODERATE"
    return "POOR"


def iid_alpha(tokens_per_round: float, k: float) -> float:
    """The per-token acceptance probability alpha of Leviathan et al. (i.i.d. positions)
    that gives ``tokens_per_round = (1 - alpha^(k+1)) / (1 - alpha)``, by bisection."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        expected = k + 1 if mid >= 1 else (1 - mid ** (k + 1)) / (1 - mid)
        low, high = (mid, high) if expected < tokens_per_round else (low, mid)
    return (low + high) / 2


def _pass_tps(results: list[dict[str, Any]]) -> float | None:
    """A pass's tokens per second, or None for a pass that measured nothing."""
    return sum(r["tokens"] for r in results) / sum(r["wall_s"] for r in results) \
        if results else None


def _tps(passes: list[list[dict[str, Any]]]) -> list[float]:
    return [tps for tps in map(_pass_tps, passes) if tps is not None]


def _ratios(passes: list[list[dict[str, Any]]], cloud: list[list[dict[str, Any]]]
            ) -> list[float]:
    """A configuration's speed over cloud-only's, pass by pass: each measured pass against
    cloud-only's pass of the same iteration (run minutes apart at most, under the same
    load), so that the spread says how far one pass of it may fall. Paired by iteration
    before empty passes are left out, so that one configuration's empty pass does not
    shift the rest of its passes onto cloud-only's next ones."""
    return [mine / theirs
            for mine, theirs in zip(map(_pass_tps, passes), map(_pass_tps, cloud), strict=False)
            if mine is not None and theirs]


def _sum_stats(passes: list[list[dict[str, Any]]]) -> dict[str, Any]:
    total: dict[str, Any] = {"generations": 0}
    for results in passes:
        for r in results:
            total["generations"] += 1
            for key, value in r.get("stats", {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
                elif key in ("accepted_by_position", "drafted_by_position"):
                    acc = total.setdefault(key, [])
                    acc.extend([0] * (len(value) - len(acc)))
                    for i, n in enumerate(value):
                        acc[i] += n
    return total


def _work(c: dict[str, Any]) -> tuple[Any, Any]:
    """What a configuration generates: its target, and the constraint it runs under (rows
    compare with the baselines of the same work)."""
    return c.get("target"), c.get("constraint")


def summarise(raw: dict[str, Any]) -> list[dict[str, Any]]:
    configs = raw["configs"]
    rows: list[dict[str, Any]] = []
    cloud_tps = {(c["rtt_ms"], _work(c)): statistics.median(_tps(c["passes"]))
                 for c in configs.values() if c["kind"] == "cloud" and c["passes"]}
    cloud_passes = {(c["rtt_ms"], _work(c)): c["passes"]
                    for c in configs.values() if c["kind"] == "cloud" and c["passes"]}
    # The code edits generated alone by the server (spececd api's cloud_only)
    edit_cloud = next((statistics.median(_tps(c["passes"])) for c in configs.values()
                       if c["kind"] == "api_edit" and c.get("edit_source") == "cloud-only"
                       and c["passes"]), None)
    # Each target's own autoregressive speed: the target alone in-process (transformers or
    # llama.cpp; under a constraint, SpecECD's backend masked) where it ran, else the
    # server generating alone at the lowest RTT.
    alone = {_work(c): statistics.median(_tps(c["passes"]))
             for c in configs.values()
             if c["kind"] in ("target", "llama_alone", "alone") and c["passes"]}
    lowest = min((c["rtt_ms"] for c in configs.values() if c["kind"] == "cloud"), default=None)
    for (rtt, work), speed in cloud_tps.items():
        if rtt == lowest:
            alone.setdefault(work, speed)
    # One target step, measured on the server while it generated alone (cloud-only), for
    # each target (and constraint) of the run.
    cloud_stats: dict[Any, list[dict[str, Any]]] = {}
    for c in configs.values():
        if c["kind"] == "cloud":
            cloud_stats.setdefault(_work(c), []).append(_sum_stats(c["passes"]))
    # Each generation's first pass also reads its prompt: left out of steps and rounds.
    steps = {work: (sum(s.get("verify_s", 0) - s.get("prefill_s", 0) for s in stats)
                      / max(1, sum(s.get("generated", 0) - s["generations"] for s in stats))
                      ) or None
             for work, stats in cloud_stats.items()}
    bare = {c.get("target"): _bare(c["passes"]) for c in configs.values()
            if c["kind"] == "bare" and c["passes"]}
    for name, c in configs.items():
        tps = _tps(c["passes"])
        if not tps or c["kind"] == "bare":
            continue
        target_tps = (None if c["kind"] in API_KINDS  # other requests than the baselines'
                      else alone.get(_work(c)) or (None if c.get("constraint") else
                                                   next(iter(alone.values()), None)))
        results = [r for p in c["passes"] for r in p]
        row: dict[str, Any] = {
            "config": name, "kind": c["kind"], "rtt_ms": c.get("rtt_ms"), "k": c.get("k"),
            "proactive": c.get("proactive"), "tree": c.get("tree"),
            "draft_source": c.get("draft_source"), "constraint": c.get("constraint"),
            "constrained_drafting": c.get("constrained_drafting"),
            "tokens_per_s": round(statistics.median(tps), 2),
            "tokens_per_s_min": round(min(tps), 2), "tokens_per_s_max": round(max(tps), 2),
            "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in results), 2),
            "speedup_vs_target": (round(statistics.median(tps) / target_tps, 3)
                                  if target_tps else None),
        }
        if c["kind"] in API_KINDS:
            row["setup"] = c.get("setup", "in-process")
            row["api_constrained"] = bool(c.get("api_constrained"))
            tpots = [r["tpot_s"] for r in results if "tpot_s" in r]
            if tpots:
                row["tpot_ms"] = round(1000 * statistics.median(tpots), 2)
        if c["kind"] == "api_edit":
            row["edit_source"] = c.get("edit_source")
            if edit_cloud:
                row["speedup_vs_cloud"] = round(statistics.median(tps) / edit_cloud, 3)
        cloud = cloud_tps.get((c.get("rtt_ms"), _work(c)))
        if cloud:
            row["speedup_vs_cloud"] = round(statistics.median(tps) / cloud, 3)
            ratios = _ratios(c["passes"], cloud_passes.get((c.get("rtt_ms"), _work(c)), []))
            if ratios:  # the spread over passes, each against cloud-only's in that pass
                row["speedup_vs_cloud_min"] = round(min(ratios), 3)
                row["speedup_vs_cloud_max"] = round(max(ratios), 3)
                row["speedup_vs_cloud_passes"] = [round(r, 3) for r in ratios]
        if c["kind"] == "llama_speculative":  # what llama.cpp itself counted
            drafted = sum(r.get("llama_stats", {}).get("drafted", 0) for r in results)
            accepted = sum(r.get("llama_stats", {}).get("accepted", 0) for r in results)
            if drafted:
                row["acceptance_rate"] = round(accepted / drafted, 4)
        if c["kind"] in ("spececd", "cloud"):
            s = _sum_stats(c["passes"])
            generated = max(1, s.get("generated", 0))
            wall = s.get("wall_s", 0.0)
            row["bytes_per_token"] = round(
                (s.get("bytes_sent", 0) + s.get("bytes_received", 0)) / generated, 2)
            passes = s.get("target_passes", 0)
            if passes:  # the server's side: its passes, and the positions it computed
                row["tokens_per_pass"] = round(s.get("generated", 0) / passes, 3)
                row["positions_per_token"] = round(
                    (s.get("drafted", 0) + s.get("tree_siblings", 0) + passes) / generated, 3)
            budget = _budget(c, s)
            if budget:
                row["budget_us"] = budget
            if wall:  # the share of the edge's time not spent drafting
                row["edge_wait_share"] = round(1 - s.get("draft_s", 0.0) / wall, 3)
            # Streaming (auto too, when it streams) overlaps drafting and verifying.
            if c.get("proactive") not in ("stream", "auto"):
                split = {part: round(1000 * s.get(f"{part}_s", 0.0) / generated, 3)
                         for part in ("draft", "network", "verify")}
                split["other"] = round(1000 * wall / generated - sum(split.values()), 3)
                row["time_per_token_ms"] = split
        if c["kind"] == "spececd":
            drafted, accepted, rounds = s["drafted"], s["accepted"], s["rounds"]
            # Tokens per round: the accepted drafts and the verifier's own token, where the
            # output kept it (a round cut by the end of the text may not).
            tokens_per_round = (accepted + s.get("own", rounds)) / rounds if rounds else 0.0
            alpha = accepted / drafted if drafted else 0.0
            k = c.get("k")
            if not isinstance(k, int):  # adaptive: the bound at the mean draft length
                k = drafted / rounds if rounds else 0
            row.update({
                "acceptance_rate": round(alpha, 4),
                "mean_accepted_len": round(tokens_per_round, 3),
                "acceptance_by_position": [
                    round(a / d, 4) if d else 0.0 for a, d in
                    zip(s.get("accepted_by_position", []), s.get("drafted_by_position", []),
                        strict=False)],
                "label": label(alpha),
            })
            if s.get("lookup_drafted"):  # drafts without a model: what they brought
                row["lookup_share"] = round(s.get("lookup_accepted", 0)
                                            / max(1, s.get("generated", 0)), 3)
            if c.get("constraint") and rounds:  # jump-forward drafting, per round
                row["forced_per_round"] = round(s.get("forced_tokens", 0) / rounds, 3)
                row["draft_steps_per_round"] = round(s.get("draft_steps", 0) / rounds, 3)
            step_s = steps.get(_work(c))
            if c.get("proactive") == "auto":  # what share each arm generated
                for arm in ("stream", "cloud", "plain"):
                    row[f"auto_{arm}_share"] = round(s.get(f"auto_{arm}_tokens", 0)
                                                     / max(1, s.get("generated", 0)), 3)
            later = rounds - s["generations"]  # rounds after each generation's first
            if step_s and later > 0 and drafted and \
                    c.get("proactive") not in ("stream", "auto"):
                c_ratio = (s["draft_s"] / max(1, s.get("draft_steps") or drafted)) / step_s
                v_ratio = ((s["verify_s"] - s.get("prefill_s", 0.0)) / later) / step_s
                bound = tokens_per_round / (k * c_ratio + v_ratio)
                row.update({"c": round(c_ratio, 4), "v": round(v_ratio, 4),
                            "alpha_iid": round(iid_alpha(tokens_per_round, k), 4),
                            "target_step_ms": round(1000 * step_s, 3),
                            "bound": round(bound, 3)})
                if row["speedup_vs_target"]:
                    row["achieved_over_bound"] = round(row["speedup_vs_target"] / bound, 3)
                forward = bare.get(c.get("target"))
                if forward:  # the bare forward's v at this row's positions per pass
                    positions = (drafted + s.get("tree_siblings", 0) + rounds) / rounds
                    bare_v = _interpolate(forward, positions) / forward[0]
                    row.update({"bare_v": round(bare_v, 4), "tax": round(v_ratio / bare_v, 3),
                                "positions_per_pass": round(positions, 2)})
        step_s, forward = steps.get(_work(c)), bare.get(c.get("target"))
        if c["kind"] == "cloud" and step_s and forward:  # a step against one position's
            row["tax"] = round(step_s / forward[0], 3)
        rows.append(row)
    return rows


def _bare(passes: list[list[dict[str, Any]]]) -> list[float]:
    """The bare forward's seconds for 1, 2, ... new positions: medians over prompts and
    passes."""
    runs = [r["bare_s"] for p in passes for r in p if r.get("bare_s")]
    return [statistics.median(run[i] for run in runs)
            for i in range(min(map(len, runs), default=0))]


def _interpolate(seconds: list[float], positions: float) -> float:
    """``seconds[n - 1]`` is the cost of ``n`` positions; linear between them, the last
    beyond."""
    low = min(max(int(positions), 1), len(seconds))
    if low >= len(seconds):
        return seconds[-1]
    return seconds[low - 1] + (positions - low) * (seconds[low] - seconds[low - 1])


def _budget(c: dict[str, Any], s: dict[str, Any]) -> dict[str, float]:
    """Where one pass's time goes, in microseconds: on the server (from its metrics, over
    every pass of the configuration, prompts' first passes included) the wait for a batch,
    the hand-offs to the model's thread and back, the forward and the rest of the work
    (logits processing, verification, sampling, rollback); at the edge, per exchange,
    drafting, the network and everything else it did (encoding, decoding, its loop)."""
    server: dict[str, float] = {}
    for delta in c.get("server", []):
        for key, value in delta.items():
            server[key] = server.get(key, 0.0) + value
    count = server.get("spececd_pass_seconds_count", 0.0)
    if not count:
        return {}
    def per_pass(metric: str) -> float:
        return 1e6 * server.get(f"{metric}_sum", 0.0) / count

    forward, work = per_pass("spececd_pass_forward_seconds"), per_pass("spececd_pass_work_seconds")
    budget = {"queue": 1e6 * server.get("spececd_pass_queue_seconds_sum", 0.0)
              / max(1.0, server.get("spececd_pass_queue_seconds_count", 0.0)),
              "handoff": per_pass("spececd_pass_seconds") - work,
              "forward": forward, "processing": work - forward}
    passes = s.get("target_passes", 0)
    # The edge's split, for rounds only: streaming overlaps drafting with the server's
    # steps, and a cloud-only edge's wait is all network and server.
    if passes and c["kind"] == "spececd" and c.get("proactive") not in ("stream", "auto"):
        wall, draft, net = (1e6 * s.get(key, 0.0) / passes
                            for key in ("wall_s", "draft_s", "network_s"))
        verify = 1e6 * s.get("verify_s", 0.0) / passes
        budget.update({"edge_draft": draft, "network": net, "verify_reported": verify,
                       "edge_other": wall - draft - net - verify})
    return {key: round(value, 1) for key, value in budget.items()}


COLUMNS = ["config", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
           "speedup_vs_target", "speedup_vs_cloud", "speedup_vs_cloud_min",
           "speedup_vs_cloud_max", "acceptance_rate", "mean_accepted_len",
           "alpha_iid", "c", "v", "bare_v", "tax", "positions_per_pass", "bound",
           "achieved_over_bound", "tokens_per_pass",
           "positions_per_token", "edge_wait_share", "bytes_per_token", "ttft_ms", "label",
           "constraint", "constrained_drafting", "forced_per_round", "draft_steps_per_round",
           "draft_source", "lookup_share", "tpot_ms"]


def to_csv(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow([*COLUMNS, "draft_ms", "network_ms", "verify_ms", "other_ms",
                     "acceptance_by_position"])
    for row in rows:
        split = row.get("time_per_token_ms", {})
        writer.writerow([row.get(c, "") for c in COLUMNS]
                        + [split.get(p, "") for p in ("draft", "network", "verify", "other")]
                        + [" ".join(map(str, row.get("acceptance_by_position", [])))])
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _spread(row: dict[str, Any]) -> str:
    """The ratio to cloud-only, and its spread over passes where there are several."""
    text = _cell(row.get("speedup_vs_cloud"))
    low, high = row.get("speedup_vs_cloud_min"), row.get("speedup_vs_cloud_max")
    if low is not None and high is not None and len(row.get("speedup_vs_cloud_passes", [])) > 1:
        text += f" ({_cell(low)}–{_cell(high)})"
    return text


def to_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# SpecECD benchmark",
        "",
        f"draft `{meta['draft']}` · target `{meta['target']}` · backend {meta['backend']} · "
        f"transport {meta['transport']} · mode {meta['mode']} · temperature "
        f"{meta['temperature']} · {meta['max_tokens']} tokens × {meta['num_prompts']} prompts"
        f" · {meta['iterations']} passes per configuration (+1 warm-up) · seed {meta['seed']}"
        f" · RTT {meta['rtt_ms']} ms (jitter {meta['jitter_ms']} ms) · "
        f"{meta['machine']['cpus']} CPUs, one torch thread per process"
        + (f", {meta['machine']['gpu']}" if meta["machine"].get("gpu") else "")
        + f" · target on {meta.get('device', 'cpu')} in {meta.get('dtype', 'float32')}, "
        f"draft on {meta.get('draft_device', 'cpu')} · {meta['started']} "
        f"({meta['duration_s']} s)",
        "",
        "| configuration | tokens/s (min–max) | × target | × cloud-only (min–max of "
        "passes) | acceptance "
        "| tokens/round | α | c | v | bound | achieved/bound | ms/token "
        "draft·net·verify·other | bytes/token | TTFT ms | label |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = r.get("time_per_token_ms")
        split_text = ("·".join(_cell(split[p]) for p in ("draft", "network", "verify", "other"))
                      if split else "–")
        lines.append(
            f"| {r['config']} | {_cell(r['tokens_per_s'])} ({_cell(r['tokens_per_s_min'])}–"
            f"{_cell(r['tokens_per_s_max'])}) | {_cell(r.get('speedup_vs_target'))} | "
            f"{_spread(r)} | {_cell(r.get('acceptance_rate'))} | "
            f"{_cell(r.get('mean_accepted_len'))} | {_cell(r.get('alpha_iid'))} | "
            f"{_cell(r.get('c'))} | {_cell(r.get('v'))} | "
            f"{_cell(r.get('bound'))} | {_cell(r.get('achieved_over_bound'))} | {split_text} | "
            f"{_cell(r.get('bytes_per_token'))} | {_cell(r.get('ttft_ms'))} | "
            f"{r.get('label', '–')} |")
    passes = [r for r in rows if "tokens_per_pass" in r]
    if passes:
        lines += ["", "The server's side (tokens per target pass; positions the target "
                  "computes per generated token, tree siblings included) and the share of "
                  "the edge's time not spent drafting:", "",
                  "| configuration | tokens/pass | positions/token | edge waits |",
                  "|---|---|---|---|"]
        lines += [f"| {r['config']} | {_cell(r['tokens_per_pass'])} | "
                  f"{_cell(r.get('positions_per_token'))} | {_cell(r.get('edge_wait_share'))} |"
                  for r in passes]
    taxed = [r for r in rows if "tax" in r]
    if taxed:
        lines += ["", "The tax: the server's v (a round's verify pass over a cloud-only step, "
                  "as the server reported them, each generation's first pass left out) over "
                  "the bare v (the target's bare forward over the same positions per pass "
                  "over one position, same backend and threads); for cloud-only, its step "
                  "over the bare forward of one position:", "",
                  "| configuration | positions/pass | v | bare v | tax |", "|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {_cell(r.get('positions_per_pass'))} | "
                  f"{_cell(r.get('v'))} | {_cell(r.get('bare_v'))} | {_cell(r['tax'])} |"
                  for r in taxed]
    budgets = [r for r in rows if "budget_us" in r]
    if budgets:
        parts = ("queue", "handoff", "forward", "processing", "edge_draft", "network",
                 "verify_reported", "edge_other")
        lines += ["", "Per-pass budget in microseconds. The server, from its metrics (every "
                  "pass, prompts' first included): the wait for a batch, the hand-offs to "
                  "the model's thread and back, the forward, the rest of its work (logits "
                  "processing, verification, sampling, rollback). The edge, per exchange: "
                  "drafting, the network beyond the server's time, the pass as the server "
                  "reported it, and the rest (encoding, decoding, the edge's loop):", "",
                  "| configuration | " + " | ".join(parts) + " |",
                  "|---|" + "---|" * len(parts)]
        lines += ["| " + r["config"] + " | " + " | ".join(
            _cell(r["budget_us"].get(part)) for part in parts) + " |" for r in budgets]
    constrained = [r for r in rows if r.get("constraint")]
    if constrained:
        lines += ["", "Under the JSON schema (`--json-schema`): each row against the target "
                  "alone and cloud-only under the same schema (the same text, greedy), "
                  "drafting under the schema (its forced tokens proposed without a draft "
                  "step) and unconstrained (the verifier's mask alone):", "",
                  "| configuration | tokens/s | × target (schema) | × cloud-only (schema) | "
                  "acceptance | tokens/round | forced tokens kept/round | draft steps/round |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {_cell(r['tokens_per_s'])} | "
                  f"{_cell(r.get('speedup_vs_target'))} | {_cell(r.get('speedup_vs_cloud'))} | "
                  f"{_cell(r.get('acceptance_rate'))} | {_cell(r.get('mean_accepted_len'))} | "
                  f"{_cell(r.get('forced_per_round'))} | "
                  f"{_cell(r.get('draft_steps_per_round'))} |" for r in constrained]
    served = [r for r in rows if r["kind"] in API_KINDS and r["kind"] != "api_edit"]
    if served:
        shape = meta.get("api", {})
        lines += ["", f"Through `spececd api`, started as a user starts it: "
                  f"{shape.get('concurrency')} clients streaming {shape.get('requests')} "
                  f"completions of {shape.get('output_len')} tokens after "
                  f"{shape.get('input_len')} random token ids (vLLM's benchmark client's "
                  f"shape; tokens/s over the whole run), and, one at a time, "
                  f"{shape.get('chat_requests')} chat requests a pass unconstrained "
                  f"({shape.get('chat_max_tokens')} tokens) and as many under a JSON schema "
                  f"(the in-process API):", "",
                  "| configuration | tokens/s (min–max) | TTFT ms | TPOT ms |",
                  "|---|---|---|---|"]
        lines += [f"| {r['config']} | {_cell(r['tokens_per_s'])} "
                  f"({_cell(r['tokens_per_s_min'])}–{_cell(r['tokens_per_s_max'])}) | "
                  f"{_cell(r['ttft_ms'])} | {_cell(r.get('tpot_ms'))} |" for r in served]
        chats = {r["api_constrained"]: r["tokens_per_s"] for r in served
                 if r["kind"] == "api_chat"}
        if chats.get(False) and True in chats:
            lines += ["", f"Constrained over unconstrained chat: "
                      f"{chats[True] / chats[False]:.2f}"]
    edits = [r for r in rows if r["kind"] == "api_edit"]
    if edits:
        lines += ["", "Code edits through `spececd api --server` in front of `spececd serve` "
                  "(RTT 0), one greedy completion at a time (`--edit-set`: a function and "
                  "an instruction to rename a parameter; the prediction is the function "
                  "before the edit), by where the drafts come from:", "",
                  "| configuration | tokens/s (min–max) | × cloud-only | TTFT ms |",
                  "|---|---|---|---|"]
        lines += [f"| {r['config']} | {_cell(r['tokens_per_s'])} "
                  f"({_cell(r['tokens_per_s_min'])}–{_cell(r['tokens_per_s_max'])}) | "
                  f"{_cell(r.get('speedup_vs_cloud'))} | {_cell(r['ttft_ms'])} |"
                  for r in edits]
    looked = [r for r in rows if "lookup_share" in r]
    if looked:
        lines += ["", "Drafts without a model (`--draft-source`): the share of the output "
                  "that was looked up and accepted:", ""]
        lines += [f"- {r['config']}: {r['lookup_share']:.2f}" for r in looked]
    auto = [r for r in rows if "auto_stream_share" in r]
    if auto:
        lines += ["", "Share of the tokens `auto` generated by each strategy:", ""]
        lines += [f"- {r['config']}: stream drafting "
                  f"{r['auto_stream_share'] - r.get('auto_cloud_share', 0.0):.2f}, the server "
                  f"alone {r.get('auto_cloud_share', 0.0):.2f}, plain rounds "
                  f"{r['auto_plain_share']:.2f}, block-ahead rounds "
                  f"{max(0.0, 1 - r['auto_stream_share'] - r['auto_plain_share']):.2f}"
                  for r in auto]
    lines += _auto_table(rows)
    positions = [r for r in rows if r.get("acceptance_by_position")]
    if positions:
        lines += ["", "Acceptance by draft position:", ""]
        lines += [f"- {r['config']}: " + ", ".join(f"{a:.2f}" for a in
                                                  r["acceptance_by_position"])
                  for r in positions]
    return "\n".join(lines) + "\n"


def _auto_table(rows: list[dict[str, Any]]) -> list[str]:
    """`auto` beside the settings it chooses between, at each RTT (and pair): each one's
    ratio to cloud-only, median and the min–max over passes, and `auto` over the best
    of the others' medians."""
    settings = ("off", "on", "stream", "auto")
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if (r["kind"] == "spececd" and r.get("proactive") in settings and r.get("k") == "auto"
                and not r.get("constraint") and "speedup_vs_cloud" in r):
            key = _AT_RTT.sub("", config_key(r)) + f" @ RTT {r['rtt_ms']:g} ms"
            groups.setdefault(key, {})[r["proactive"]] = r
    groups = {key: group for key, group in groups.items() if "auto" in group and len(group) > 1}
    if not groups:
        return []
    lines = ["", "`auto` beside the settings it chooses between: × cloud-only, median "
             "(min–max over passes, each against cloud-only's pass of the same iteration), "
             "and `auto` over the best other setting's median:", "",
             "| configuration | plain | block-ahead | stream | **auto** | auto ÷ best |",
             "|---|---|---|---|---|---|"]
    for key, group in groups.items():
        others = [group[p]["speedup_vs_cloud"] for p in settings[:3] if p in group]
        best = max(others, default=None)
        lines.append(f"| {key} | " + " | ".join(
            _spread(group[p]) if p in group else "–" for p in settings[:3])
            + f" | **{_spread(group['auto'])}** | "
            + (f"{group['auto']['speedup_vs_cloud'] / best:.3f} |" if best else "– |"))
    return lines


def config_key(row: dict[str, Any]) -> str:
    """A row's configuration without its proactive setting (the group `auto` is in)."""
    config: str = row["config"]
    return config.replace(f" {_SETTING[row['proactive']]}", "", 1)


_SETTING = {"off": "plain", "on": "proactive", "stream": "stream", "auto": "auto"}


def draw(plot: Callable[..., None], *args: Any) -> bool:
    """``plot(*args)`` where matplotlib is installed, and True; else a log line says the
    plots were skipped and how to get them, and False."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("plots skipped: matplotlib is not installed (pip install matplotlib "
                    "draws them on the next run); the figures are all in the JSON, CSV "
                    "and Markdown files")
        return False
    plot(*args)
    return True


def plots(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # One line per configuration across RTTs: its name without the RTT (which keeps a
    # pair's tag, so that each pair of a comparison has lines of its own).
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["rtt_ms"] is not None and r.get("speedup_vs_target"):
            lines.setdefault(_AT_RTT.sub("", r["config"]), []).append(
                (r["rtt_ms"], r["speedup_vs_target"]))
    for name, series in lines.items():
        ax.plot(*zip(*sorted(series), strict=True), marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("round-trip time (ms)")
    ax.set_ylabel("speedup vs the target alone")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_rtt.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r.get("acceptance_by_position") and r["rtt_ms"] == min(
                x["rtt_ms"] for x in rows if x["rtt_ms"] is not None):
            ax.plot(range(1, len(r["acceptance_by_position"]) + 1),
                    r["acceptance_by_position"], marker="o", label=r["config"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    names = [r["config"] for r in rows]
    ax.barh(names, [r["tokens_per_s"] for r in rows],
            xerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in rows],
                  [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rows]])
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median, min–max over passes)")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=110)
    plt.close(fig)
