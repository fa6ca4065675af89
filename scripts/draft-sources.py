"""Where drafts come from, counted: target passes and draft model steps per generated token
for each draft source (docs/guide/lookup.md's table; the measurement behind ``auto``'s
choice of the hybrid where a draft model is loaded).

    python scripts/draft-sources.py [DRAFT] [TARGET]

In-process, greedy, ``k`` fixed at 8 in plain rounds, 128 tokens per prompt with no stop
token, on the held-out code prompts (the first 8) and the copy-heavy set
(``models/copy_prompts.json``). Counts, not timings: they depend on the models and the
prompts only. Checks that every source's output is the model's own (the target's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spececd.core.stats import GenerationStats
from spececd.generator import Generator

MODELS = Path(__file__).resolve().parents[1] / "models"
SOURCES = ("model", "lookup", "suffix", "hybrid")


def main() -> None:
    draft = sys.argv[1] if len(sys.argv) > 1 else str(MODELS / "draft")
    target = sys.argv[2] if len(sys.argv) > 2 else str(MODELS / "target")
    sets = {"held-out code": json.loads((MODELS / "heldout_prompts.json").read_text())[:8],
            "copy-heavy": json.loads((MODELS / "copy_prompts.json").read_text())}
    print("| source | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    with Generator.load(draft, target, device="cpu", dtype="float32") as gen:
        reference: dict[str, list[list[int]]] = {}
        for source in SOURCES:
            cells = []
            for name, prompts in sets.items():
                total, outputs = GenerationStats(), []
                options = gen.options.with_settings(draft_source=source, k=8, proactive="off")
                for prompt in prompts:
                    done = gen.generate(prompt, max_tokens=128, temperature=0,
                                        stop_token_ids=[], options=options)
                    total.merge(done.stats)
                    outputs.append(done.token_ids)
                assert reference.setdefault(name, outputs) == outputs, (source, name)
                cells.append(f"{total.target_passes / total.generated:.2f} passes/token, "
                             f"{total.draft_steps} draft steps, {total.lookup_accepted} of "
                             f"{total.lookup_drafted} looked up kept")
            print(f"| {source} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
