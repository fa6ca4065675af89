"""Pick a backend for a model spec. Backends are imported only when used.

- a path ending in ``.gguf`` (or ``backend="llama.cpp"``): llama.cpp;
- a folder with ``genai_config.json``: ONNX Runtime GenAI;
- a folder with ``openvino_model.xml``: OpenVINO;
- anything else (a local folder or a hub id): Hugging Face transformers on PyTorch.

Devices are the backend's (``spececd devices`` lists them). ``npu`` asks for the neural
processing unit of the model's runtime: OpenVINO's ``NPU`` for an OpenVINO folder, the QNN
execution provider for an ONNX folder. Where the runtime has none, or the model's format
runs on no NPU (transformers, GGUF), or the config turns the NPU off
(``npu = false``), the model runs on the CPU after a one-line notice.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from spececd.backends.base import Backend, Tokenizer
from spececd.errors import InputError

log = logging.getLogger(__name__)

BACKENDS = ("hf", "llama.cpp", "onnx", "openvino")
# What each backend imports (the tokenizer of ONNX and OpenVINO folders is transformers'),
# what people call it, and the extra of spececd that installs it.
REQUIRES = {"hf": ("torch", "transformers"), "llama.cpp": ("llama_cpp",),
            "onnx": ("onnxruntime_genai", "transformers"),
            "openvino": ("openvino", "transformers")}
RUNTIME_NAMES = {"hf": "transformers", "llama.cpp": "llama.cpp",
                 "onnx": "ONNX Runtime GenAI", "openvino": "OpenVINO"}
EXTRAS = {"hf": "hf", "llama.cpp": "llama", "onnx": "onnx", "openvino": "openvino"}
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
    return all(importlib.util.find_spec(name) is not None for name in REQUIRES[backend])


def is_npu(device: dict[str, str]) -> bool:
    """Whether an entry of :func:`available_devices` is a neural processing unit."""
    return device["device"] == "qnn" or device["device"].split(".")[0] == "npu"


def npu_device(backend: str, npu: bool = True) -> str:
    """What ``--device npu`` becomes for ``backend``: its NPU, or cpu with a notice."""
    if not npu:
        log.warning("device npu requested but the NPU is turned off (npu = false); "
                    "running on cpu")
        return "cpu"
    if backend == "openvino":
        from spececd.backends import openvino

        if openvino.has_npu():
            return "npu"
        log.warning("device npu requested but OpenVINO finds no NPU here; running on cpu")
        return "cpu"
    if backend == "onnx":
        from spececd.backends import onnx

        if onnx.has_npu():
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


def available_devices() -> list[dict[str, str]]:
    """Every device a model can run on here, with the backend that uses it."""
    devices: list[dict[str, str]] = []
    if importlib.util.find_spec("torch") is not None:
        from spececd.backends import hf

        devices.extend(hf.available_devices())
    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        devices.append({"device": "cpu", "backend": "llama.cpp",
                        "detail": f"llama.cpp {llama_cpp.__version__}"
                        + (", GPU offload available" if gpu else ", CPU build")})
    if importlib.util.find_spec("onnxruntime_genai") is not None:
        from spececd.backends import onnx

        devices.extend(onnx.devices())
    if importlib.util.find_spec("openvino") is not None:
        from spececd.backends import openvino

        devices.extend(openvino.devices())
    return devices
