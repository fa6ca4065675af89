"""``spececd convert``: a transformers model folder to a GGUF file (llama.cpp's converter),
an ONNX Runtime GenAI folder (onnxruntime-genai's model builder) or an OpenVINO folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_QUANT = {"gguf": "f16", "onnx": "fp32", "openvino": "fp32"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a transformers model folder to GGUF "
                       "(llama.cpp), ONNX Runtime GenAI or OpenVINO")
    p.add_argument("--to", choices=list(DEFAULT_QUANT), default="gguf",
                   help="gguf: a file for llama.cpp; onnx: a folder for ONNX Runtime GenAI "
                   "(CPU, CUDA, DirectML, QNN); openvino: a folder for OpenVINO (CPU, Intel "
                   "GPU and NPU) (default: gguf)")
    p.add_argument("--quant", "--weight-format", dest="quant",
                   help="gguf: f32, f16 (default), bf16, q8_0 (written by the converter) or "
                   "q4_0, q4_k_m, q5_k_m, q6_k, ... (llama.cpp's quantizer); onnx: fp32 "
                   "(default), int8, int4; openvino: fp32 (default), fp16, int8, int4 (NNCF)")
    p.add_argument("model_dir", type=Path, help="folder saved with save_pretrained")
    p.add_argument("out", type=Path, help="GGUF file, or folder, to write")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    quant = (args.quant or DEFAULT_QUANT[args.to]).lower()
    if args.to == "gguf":
        from spececd.convert import convert

        out = convert(args.model_dir, args.out, quant)
        size = out.stat().st_size
    else:
        if args.to == "onnx":
            from spececd.backends.onnx import export
        else:
            from spececd.backends.openvino import export  # type: ignore[assignment]
        out = export(args.model_dir, args.out, quant)
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB, {quant})", file=sys.stderr)
    return 0
