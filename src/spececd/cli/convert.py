"""``spececd convert``: a transformers model folder to GGUF, with llama.cpp's converter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a transformers model folder to GGUF with "
                       "llama.cpp's own converter")
    p.add_argument("--to", choices=["gguf"], default="gguf")
    p.add_argument("--quant", default="f16", help="f32, f16, bf16, q8_0 (written by the "
                   "converter) or q4_0, q4_k_m, q5_k_m, q6_k, ... (llama.cpp's quantizer)")
    p.add_argument("model_dir", type=Path, help="folder saved with save_pretrained")
    p.add_argument("out", type=Path, help="GGUF file to write")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from spececd.convert import convert

    out = convert(args.model_dir, args.out, args.quant)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.quant})", file=sys.stderr)
    return 0
