"""The browser edge's speed, side by side with cloud-only and the Python edge, in one run.

Drives the page that `spececd serve` serves (web/, built) in headless Chromium through its
`window.spececd.run`, against a server started with the ONNX draft offered to pages:

    spececd serve --port 8765 --web-draft models/draft
    python scripts/bench-browser.py --server ws://127.0.0.1:8765

For each prompt, interleaved: the page's cloud-only run, its lookup run, its model run
(its runtime: WASM, or WebGPU where the browser has a hardware adapter; blocks drafted
ahead, or plain rounds for `model:plain`) and the Python edge with the same draft at the
same k (plain rounds, exact mode), all greedy, so every run writes the same tokens.
Prints a JSON line per run and the totals: tokens/s (total tokens over total seconds) and
acceptance (accepted over drafted), and each ratio to the page's cloud-only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RUN = """async (options) => {
    const r = await spececd.run(options);
    const s = r.stats;
    return {tokens: r.tokens, generated: s.generated, wall: s.wallSeconds, drafted: s.drafted,
            accepted: s.accepted, runtime: r.runtime};
}"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="ws://127.0.0.1:8765")
    parser.add_argument("--token", default="", help="the server's auth token, if it needs one")
    parser.add_argument("--prompts", default="models/copy_prompts.json")
    parser.add_argument("--num-prompts", type=int, default=0, help="0: all")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", default="4", help="draft length of the model runs: a number, "
                        "or auto (the page's; the Python edge's runs need a number)")
    parser.add_argument("--lookup-k", default="8", help="draft length of the lookup runs: a "
                        "number, or auto (free drafts as far as the server's pass width)")
    parser.add_argument("--draft-model", default="models/draft-onnx",
                        help="the Python edge's draft (default: the int8 ONNX form, its "
                        "fastest; the server's fp32 export in ~/.cache/spececd/web-drafts "
                        "is the page's own)")
    parser.add_argument("--sources", default="cloud,lookup,model,python",
                        help="which runs, of cloud, lookup, model, hybrid, python; the page's "
                        "drafting runs draft blocks ahead, and with ':plain' (model:plain) "
                        "run plain rounds")
    parser.add_argument("--chromium", default="/usr/lib/chromium/chromium")
    args = parser.parse_args()
    k: int | str = args.k if args.k == "auto" else int(args.k)
    lookup_k: int | str = args.lookup_k if args.lookup_k == "auto" else int(args.lookup_k)

    from playwright.sync_api import sync_playwright

    from spececd.backends.registry import load_backend
    from spececd.edge.options import DraftKind, EdgeOptions, Proactive
    from spececd.generator import Generator
    from spececd.transports.registry import connector

    prompts: list[str] = json.loads(Path(args.prompts).read_text())
    prompts = prompts[:args.num_prompts or None]
    sources = args.sources.split(",")
    totals: dict[str, dict[str, float]] = {}
    python = None
    if "python" in sources:
        draft = load_backend(args.draft_model, device="cpu")
        options = EdgeOptions(k=None if k == "auto" else int(k), proactive=Proactive.OFF,
                              draft_source=DraftKind.MODEL)
        python = Generator.remote(draft, args.server,
                                  connector(args.server, auth_token=args.token),
                                  auth_token=args.token, options=options)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium)
        tab = browser.new_page()
        http = args.server.replace("ws://", "http://").replace("wss://", "https://")
        tab.goto(f"{http}/?server={args.server}")
        tab.wait_for_function("window.spececd !== undefined")
        warm = {"prompt": prompts[0], "token": args.token, "maxTokens": 8, "temperature": 0}
        for source in sources:  # load the tokenizer and the draft before timing
            kind, plain = source.split(":")[0], source.endswith(":plain")
            if kind in ("lookup", "model", "hybrid"):
                tab.evaluate(RUN, {**warm, "source": kind, "ahead": not plain,
                                   "k": lookup_k if kind == "lookup" else k})
        for i, prompt in enumerate(prompts):
            for source in sources:
                if source == "python":
                    assert python is not None
                    done = python.generate(prompt, max_tokens=args.max_tokens, temperature=0,
                                           token_healing=True)
                    s = done.stats
                    row: dict[str, Any] = {
                        "tokens": done.token_ids, "generated": s.generated, "wall": s.wall_s,
                        "drafted": s.drafted, "accepted": s.accepted, "runtime": "python"}
                else:
                    kind, plain = source.split(":")[0], source.endswith(":plain")
                    row = tab.evaluate(RUN, {
                        "prompt": prompt, "token": args.token, "maxTokens": args.max_tokens,
                        "temperature": 0, "source": kind, "ahead": not plain,
                        "k": lookup_k if kind == "lookup" else k})
                total = totals.setdefault(source, dict.fromkeys(
                    ("generated", "wall", "drafted", "accepted"), 0.0))
                for key in total:
                    total[key] += row[key]
                print(json.dumps({"prompt": i, "source": source, "runtime": row["runtime"],
                                  **{k: row[k] for k in total}}), flush=True)
        browser.close()
    if python is not None:
        python.close()
    base = totals.get("cloud")
    for source, total in totals.items():
        tps = total["generated"] / total["wall"]
        line = {"source": source, "tokens_per_s": round(tps, 2),
                "acceptance": round(total["accepted"] / total["drafted"], 4)
                if total["drafted"] else None}
        if base is not None:
            line["x_cloud_only"] = round(tps / (base["generated"] / base["wall"]), 3)
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
