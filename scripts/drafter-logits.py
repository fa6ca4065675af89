"""Logit differences and draft step times of converted drafts against the transformers
draft they came from, on held-out text (docs/drafters-2026-11-22.md).

    python scripts/drafter-logits.py models/draft models/target DRAFT [DRAFT ...]

Each DRAFT (a GGUF file, an ONNX or OpenVINO folder) runs on the CPU on one thread: a
100-token prefill, then one token per step over 400 held-out tokens. Prints a Markdown
row per draft: max |Δlogit|, the share of positions whose argmax equals the transformers
draft's and the target's, and milliseconds per one-token step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from spececd.backends.registry import load_backend


def step_ms(backend: object, ids: list[int]) -> float:
    seq = backend.new_sequence()  # type: ignore[attr-defined]
    seq.extend(ids[:50], keep=0)
    start = time.perf_counter()
    for token in ids[50:250]:
        seq.extend([token], keep=1)
    return (time.perf_counter() - start) / 200 * 1e3


def main(reference: str, target: str, drafts: list[str]) -> None:
    torch.set_num_threads(1)
    prompts = json.loads((Path("models") / "heldout_prompts.json").read_text())
    hf = load_backend(reference, device="cpu", dtype="float32", threads=1)
    ids = hf.tokenizer.encode("".join(prompts))[:400]
    expected = hf.new_sequence().extend(ids)
    target_argmax = load_backend(target, device="cpu", dtype="float32").new_sequence() \
        .extend(ids).argmax(1)
    print("| drafter | max abs Δlogit | agrees with the draft | agrees with the target | "
          "ms per step |")
    print(f"| {reference} | 0 | 1 | {(expected.argmax(1) == target_argmax).mean():.3f} | "
          f"{step_ms(hf, ids):.2f} |")
    for name in drafts:
        backend = load_backend(name, device="cpu", threads=1)
        seq = backend.new_sequence()
        got = np.concatenate([seq.extend(ids[:100]), *(seq.extend([t]) for t in ids[100:])])
        print(f"| {name} | {np.abs(got - expected).max():.2e} | "
              f"{(got.argmax(1) == expected.argmax(1)).mean():.3f} | "
              f"{(got.argmax(1) == target_argmax).mean():.3f} | {step_ms(backend, ids):.2f} |",
              flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
