"""The default draft in each runtime, side by side: what one draft step costs and how fast
the demo's in-process generation runs with it (the measurement behind
``spececd.cli.options.default_draft``'s order; models/README.md).

    python scripts/draft-runtimes.py models/draft models/draft.gguf models/draft-onnx ...

For one torch thread and for two (one process each: torch's thread count is the
process's), every DRAFT (a transformers folder, a GGUF file, an ONNX Runtime GenAI folder)
is loaded with the default target (transformers, float32, CPU) and, in turns, three passes:

- one-token steps after a 150-token prefill (80 of them, the median), and the target's;
- the demo's generation, in-process: two built-in prompts, 64 tokens each, greedy and
  with the demo's sampling (temperature 0.7, repetition penalty 1.2, seed 0), k auto.

Prints a Markdown table per thread count, with medians over the passes, and checks that
every draft's greedy output is the target's (the same ids from each).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PASSES = 3
SAMPLED = {"temperature": 0.7, "repetition_penalty": 1.2, "seed": 0}
GREEDY = {"temperature": 0.0, "repetition_penalty": 1.0}


def step_ms(backend: object, ids: list[int]) -> float:
    seq = backend.new_sequence()  # type: ignore[attr-defined]
    seq.extend(ids[:150], keep=0)
    times = []
    for token in ids[150:230]:
        start = time.perf_counter()
        seq.extend([token], keep=1)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def tokens_per_s(gen: object, prompts: list[str], sampling: dict[str, float]) -> tuple[
        float, list[list[int]]]:
    outputs, tokens, start = [], 0, time.perf_counter()
    for prompt in prompts:
        out = gen.generate(prompt, max_tokens=64, stop_token_ids=[],  # type: ignore[attr-defined]
                           **sampling)
        outputs.append(out.token_ids)
        tokens += len(out.token_ids)
    return tokens / (time.perf_counter() - start), outputs


def child(threads: int, drafts: list[str]) -> None:
    from spececd.generator import Generator

    prompts = json.loads(Path("models/heldout_prompts.json").read_text())
    gens = [Generator.load(d, "models/target", device="cpu", dtype="float32", threads=threads,
                           k="auto") for d in drafts]
    ids = gens[0].tokenizer.encode("".join(prompts))[:230]
    rows: dict[str, dict[str, list[float]]] = {d: {} for d in [*drafts, "target"]}
    greedy: dict[str, list[list[int]]] = {}
    for _ in range(PASSES):
        rows["target"].setdefault("step", []).append(step_ms(gens[0].target_backend, ids))
        for draft, gen in zip(drafts, gens, strict=True):
            row = rows[draft]
            row.setdefault("step", []).append(step_ms(gen.draft_backend, ids))
            rate, greedy[draft] = tokens_per_s(gen, prompts[:2], GREEDY)
            row.setdefault("greedy", []).append(rate)
            row.setdefault("sampled", []).append(tokens_per_s(gen, prompts[:2], SAMPLED)[0])
    for gen in gens:
        gen.close()
    same = all(out == greedy[drafts[0]] for out in greedy.values())
    print(json.dumps({"rows": {k: {m: statistics.median(v) for m, v in row.items()}
                               for k, row in rows.items()},
                      "greedy_identical": same}))


def main(drafts: list[str]) -> None:
    for threads in (1, 2):
        result = subprocess.run([sys.executable, __file__, "--child", str(threads), *drafts],
                                capture_output=True, text=True, check=True)
        report = json.loads(result.stdout.strip().splitlines()[-1])
        rows = report["rows"]
        target = rows.pop("target")["step"]
        print(f"\n{threads} thread(s): target step {target:.2f} ms; greedy output identical "
              f"across drafts: {report['greedy_identical']}\n")
        print("| draft | ms per step | c | demo greedy, tokens/s | demo sampled, tokens/s |")
        print("|---|---|---|---|---|")
        for draft, row in rows.items():
            print(f"| {draft} | {row['step']:.3f} | {row['step'] / target:.3f} | "
                  f"{row['greedy']:.1f} | {row['sampled']:.1f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) > 1:
        main(sys.argv[1:])
    else:
        sys.exit(__doc__)
