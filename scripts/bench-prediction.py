"""Predicted Outputs where the reply follows the prediction: tokens per target pass and wall
clock through ``spececd api --server`` in front of ``spececd serve``, side by side.

For each item of the code-edit set (``models/edit_set.json``) the target's own greedy reply
is taken first (cloud-only); the prediction is that reply with a few lines changed (an
identifier renamed on ``--changed`` lines spread through it), the shape of an edit whose
reply is known but for a few lines. Each item is then asked again, greedy, one request at a
time, interleaved row by row:

- ``prediction``: with the prediction (the API's own drafts where the reply leaves it);
- ``prediction, 8 a pass``: the same against a server whose ``--max-draft 8`` holds every
  round to 8 drafts, what a pass verified before long passes;
- ``no prediction``: the API's own drafts only;
- ``cloud-only``: the server alone.

Every row's text must be the cloud-only reply (greedy is lossless); the script says so
or names the items that differ. Prints a Markdown table and writes ``--out`` as JSON.

    python scripts/bench-prediction.py [--limit 12] [--changed 3] [--out bench-prediction.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from spececd.bench.api import Process, start

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("prediction", "prediction, 8 a pass", "no prediction", "cloud-only")


def changed(reply: str, lines: int) -> str:
    """``reply`` with ``lines`` of its non-blank lines, spread through it, changed: the first
    identifier on each renamed."""
    text = reply.split("\n")
    filled = [i for i, line in enumerate(text) if re.search(r"[A-Za-z_]", line)]
    for j in range(lines):
        if not filled:
            break
        i = filled[(j + 1) * len(filled) // (lines + 1)]
        text[i] = re.sub(r"[A-Za-z_]\w*", lambda match: match.group() + "_old", text[i],
                         count=1)
    return "\n".join(text)


def complete(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """POST a completion to the API at ``url``: the response and its seconds."""
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        out = json.load(response)
    return out, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edit-set", default=str(ROOT / "models" / "edit_set.json"))
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--changed", type=int, default=3, help="lines of the reply changed")
    parser.add_argument("--draft-model", default=str(ROOT / "models" / "draft-onnx"))
    parser.add_argument("--target-model", default=str(ROOT / "models" / "target"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="bench-prediction.json")
    args = parser.parse_args()
    items = json.loads(Path(args.edit_set).read_text())[:args.limit]
    procs: list[Process] = []
    try:
        wide = start("two-process", args.draft_model, args.target_model, dtype=args.dtype)
        procs += wide
        narrow = start("two-process", args.draft_model, args.target_model, dtype=args.dtype,
                       server=["--max-draft", "8"])
        procs += narrow
        urls = {"prediction": wide[-1].url, "prediction, 8 a pass": narrow[-1].url,
                "no prediction": wide[-1].url, "cloud-only": wide[-1].url}
        totals = {row: {"tokens": 0, "seconds": 0.0, "passes": 0, "accepted": 0,
                        "predicted": 0} for row in ROWS}
        differ: list[int] = []
        for n, item in enumerate(items):
            base = {"model": "spececd", "prompt": item["prompt"],
                    "max_tokens": item["max_tokens"], "temperature": 0}
            reply, _ = complete(wide[-1].url, {**base, "cloud_only": True})  # the reference
            expected = reply["choices"][0]["text"]
            prediction = changed(expected, args.changed)
            for row in ROWS:
                body = dict(base)
                if row.startswith("prediction"):
                    body["prediction"] = {"type": "content", "content": prediction}
                if row == "cloud-only":
                    body["cloud_only"] = True
                out, seconds = complete(urls[row], body)
                if out["choices"][0]["text"] != expected:
                    differ.append(n)
                usage, spec = out["usage"], out["speculative"]
                total = totals[row]
                total["tokens"] += usage["completion_tokens"]
                total["seconds"] += seconds
                total["passes"] += spec["target_passes"]
                details = usage.get("completion_tokens_details") or {}
                total["accepted"] += details.get("accepted_prediction_tokens", 0)
                total["predicted"] += (details.get("accepted_prediction_tokens", 0)
                                       + details.get("rejected_prediction_tokens", 0))
            print(f"item {n + 1}/{len(items)} done", flush=True)
    finally:
        for proc in reversed(procs):
            proc.stop()
    cloud = totals["cloud-only"]
    base_speed = cloud["tokens"] / cloud["seconds"]
    without = totals["no prediction"]
    lines = ["| drafts | tokens | tokens/s | × cloud-only | tokens per target pass | "
             "prediction tokens accepted |", "|---|---|---|---|---|---|"]
    for row in ROWS:
        t = totals[row]
        speed = t["tokens"] / t["seconds"]
        accepted = f"{t['accepted']} of {t['predicted']}" if t["predicted"] else "–"
        lines.append(f"| {row} | {t['tokens']} | {speed:.1f} | {speed / base_speed:.2f} | "
                     f"{t['tokens'] / t['passes']:.2f} | {accepted} |")
    print("\n".join(lines))
    ratio = (totals["prediction"]["tokens"] / totals["prediction"]["passes"]) / (
        without["tokens"] / without["passes"])
    print(f"tokens per pass, prediction / no prediction: {ratio:.2f}x")
    print("every row's text is the cloud-only reply" if not differ else
          f"text differs from cloud-only on items {sorted(set(differ))}")
    Path(args.out).write_text(json.dumps({"totals": totals, "differ": sorted(set(differ)),
                                          "items": len(items), "changed": args.changed},
                                         indent=2))


if __name__ == "__main__":
    main()
