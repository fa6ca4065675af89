#!/usr/bin/env python3
"""A cost-scaled stand-in for an 8B-class target, in the formats of a deployment: the target
as transformers loads it (safetensors, its stored dtype: bfloat16 for the default target)
and as a llama.cpp verifier loads it (GGUF Q8_0), and the draft in GGUF Q4_K_M (a laptop's
llama.cpp draft). spececd.bench.standin says how the copy keeps the original's logits.

usage: python scripts/make-standin.py OUT [--target models/target] [--draft models/draft]
           [--layers 32] [--intermediate 163840] [--no-gguf]

32 x 163840 from the default target costs what an 8B model's forward does (about 8.6B
parameters, 17 GB in bfloat16: mind the disk); 16 x 20480 (0.52B) is the CPU's stand-in of
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from spececd.bench.standin import scale_target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--target", type=Path, default=Path("models/target"))
    p.add_argument("--draft", type=Path, default=Path("models/draft"))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=163840)
    p.add_argument("--no-gguf", action="store_true", help="the safetensors copy only")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    hf = args.out / "target"
    n = scale_target(args.target, hf, args.layers, args.intermediate)
    print(f"stand-in: {args.layers} layers x {args.intermediate}, {n / 1e9:.2f}B parameters "
          f"-> {hf}")
    if not args.no_gguf:
        from spececd.convert import convert

        for model, out, quant in ((hf, args.out / "target-q8_0.gguf", "q8_0"),
                                  (args.draft, args.out / "draft-q4_k_m.gguf", "q4_k_m")):
            convert(model, out, quant)
            print(f"{quant}: {out} ({out.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
