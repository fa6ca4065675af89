"""Pick a backend for a model spec. Backends are imported only when used.

- a path ending in ``.gguf`` (or ``backend="llama.cpp"``): llama.cpp;
- a folder with ``genai_config.json``: ONNX Runtime GenAI;
- a folder with ``openvino_model.xml``: OpenVINO;
- anything else (a local folder or a hub id): Hugging Face transformers on PyTorch.

:data:`SPECS` is the table of backends: each one's name, what it imports, what people call
it and the extra that installs it. Devices are the backend's (:mod:`spececd.backends.devices`
finds them; ``spececd devices`` lists them). ``npu`` asks for the neural processing unit of
the model's runtime: OpenVINO's ``NPU`` for an OpenVINO folder, the QNN
execution provider for an ONNX folder. Where the runtime has none, or the model's format
runs on no NPU (transformers, GGUF), or the config turns the NPU off
(``npu = false``), the model runs on the CPU after a one-line notice.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from spececd.backends.base import Backend, Tokenizer
from spececd.backends.devices import has_npu
from spececd.errors import InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendSpec:
    """One model runtime as the registry knows it."""

    name: str  # as --backend takes it
    runtime: str  # what people call it
    requires: tuple[str, ...]  # what it imports (ONNX and OpenVINO folders: transformers too)
    extra: str  # the extra of spececd that installs it


SPECS = {spec.name: spec for spec in (
    BackendSpec("hf", "transformers", ("torch", "transformers"), "hf"),
    BackendSpec("llama.cpp", "llama.cpp", ("llama_cpp",), "llama"),
    BackendSpec("onnx", "ONNX Runtime GenAI", ("onnxruntime_genai", "transformers"), "onnx"),
    BackendSpec("openvino", "OpenVINO", ("openvino", "transformers"), "openvino"),
)}
BACKENDS = tuple(SPECS)
CONVERT_HINT = ("`spececd convert --to openvino` makes an OpenVINO folder for an Intel NPU; "
                "a Snapdragon NPU runs an ONNX folder through ONNX Runtime's QNN provider")


def model_format(model: str) -> str:
    """The backend a model spec is for, from its file name or folder contents."""
    from spececd.backends import onnx, openvino  # light: their runtimes load when used

    if model.lower().endswith(".gguf"):
        return "llama.cpp"
    path = Path(model).expanduser()
    if onnx.is_model_folder(path):
        return "onnx"
    if openvino.is_model_folder(path):
        return "openvino"
    return "hf"


def installed(backend: str) -> bool:
    """Whether ``backend``'s runtime can be imported here (without importing it)."""
    return all(importlib.util.find_spec(name) is not None for name in SPECS[backend].requires)


def npu_device(backend: str, npu: bool = True) -> str:
    """What ``--device npu`` becomes for ``backend``: its NPU, or cpu with a notice."""
    if not npu:
        log.warning("device npu requested but the NPU is turned off (npu = false); "
                    "running on cpu")
        return "cpu"
    if backend == "openvino":
        if has_npu("openvino"):
            return "npu"
        log.warning("device npu requested but OpenVINO finds no NPU here; running on cpu")
        return "cpu"
    if backend == "onnx":
        if has_npu("onnx"):
            return "qnn"
        log.warning("device npu requested but this ONNX Runtime build has no NPU execution "
                    "provider (QNN); running on cpu")
        return "cpu"
    log.warning("device npu requested but %s models do not run on an NPU (%s); running on "
                "cpu", "GGUF" if backend == "llama.cpp" else "transformers", CONVERT_HINT)
    return "cpu"


def load_backend(model: str, device: str = "auto", dtype: str = "auto",
                 backend: str = "auto", threads: int = 0, npu: bool = True) -> Backend:
    """Load ``model`` (a local folder, a hub id, a GGUF file, an ONNX or OpenVINO folder)
    with the named backend. For llama.cpp, ``device`` other than cpu offloads every layer to
    the build's GPU. ``npu``: whether ``device="npu"`` may use an NPU at all."""
    if backend not in ("auto", *BACKENDS):
        raise InputError(f"unknown backend {backend!r}: use one of auto, {', '.join(BACKENDS)}")
    kind = model_format(model) if backend == "auto" else backend
    if device == "npu":
        device = npu_device(kind, npu)
    if kind == "llama.cpp":
        from spececd.backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend(model, n_threads=threads,
                               n_gpu_layers=0 if device in ("cpu", "auto") else -1)
    if kind == "onnx":
        from spececd.backends.onnx import OnnxBackend

        return OnnxBackend(model, device="cpu" if device == "auto" else device, threads=threads)
    if kind == "openvino":
        from spececd.backends.openvino import OpenVinoBackend

        return OpenVinoBackend(model, device="cpu" if device == "auto" else device,
                               threads=threads)
    if not installed("hf"):
        raise InputError("the Hugging Face backend needs torch and transformers: "
                         "pip install torch==2.13.0 'spececd[hf]'")
    from spececd.backends.hf import HFBackend

    return HFBackend(model, device=device, dtype=dtype, threads=threads)


def load_tokenizer(model: str) -> tuple[Tokenizer, int]:
    """A model's tokenizer alone, and how many token ids it has: a transformers folder or
    hub id (for an edge whose draft has another tokenizer than the server's target)."""
    if model.lower().endswith(".gguf"):
        raise InputError("the target tokenizer must be a transformers folder or hub id "
                         "(tokenizer files), not a GGUF file")
    if importlib.util.find_spec("transformers") is None:
        raise InputError("loading a tokenizer needs transformers: pip install 'spececd[hf]'")
    from spececd.backends.hf_tokenizer import load_tokenizer as load_hf_tokenizer

    return load_hf_tokenizer(model)
