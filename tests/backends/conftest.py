"""Converted models, made once a session and shared by the modules of tests/backends: the
tiny transformers models of :func:`tests.conftest.tiny_models` as GGUF (llama.cpp), ONNX
and OpenVINO folders, each converted the first time a test asks for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

Converted = Callable[[str, str], Path]  # (format, model name) -> its converted model


@pytest.fixture(scope="session")
def converted(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> Converted:
    """``converted(fmt, name)``: the tiny model ``name`` converted to ``fmt`` (``gguf``,
    float32; ``onnx`` or ``openvino``, fp32, through ``spececd convert``)."""
    root = tmp_path_factory.mktemp("converted")
    done: dict[tuple[str, str], Path] = {}

    def get(fmt: str, name: str) -> Path:
        if (fmt, name) not in done:
            if fmt == "gguf":
                from spececd.convert import convert

                done[fmt, name] = convert(tiny_models[name], root / f"{name}.f32.gguf", "f32")
            else:
                from spececd.cli import main

                out = root / f"{fmt}-{name}"
                assert main(["convert", "--to", fmt, "--quant", "fp32", str(tiny_models[name]),
                             str(out)]) == 0
                done[fmt, name] = out
        return done[fmt, name]

    return get
