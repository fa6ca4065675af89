"""Device discovery: which devices each installed runtime can run a model on here.

``spececd devices`` lists :func:`available_devices`; :func:`has_npu` says whether a
backend's runtime sees a neural processing unit, which the registry asks when a user
writes ``--device npu``. Each runtime is asked only when it is installed, and through its
own backend module (which alone imports it); this module imports no runtime itself and
loads no model.
"""

from __future__ import annotations

import importlib.util


def is_npu(device: dict[str, str]) -> bool:
    """Whether an entry of :func:`available_devices` is a neural processing unit."""
    return device["device"] == "qnn" or device["device"].split(".")[0] == "npu"


def backend_devices(backend: str) -> list[dict[str, str]]:
    """The devices ``backend``'s runtime can run a model on here (none when it is not
    installed), each ``{"device", "backend", "detail"}``."""
    if backend == "hf":
        if importlib.util.find_spec("torch") is None:
            return []
        from spececd.backends import hf

        return hf.available_devices()
    if backend == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            return []
        import llama_cpp

        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        return [{"device": "cpu", "backend": "llama.cpp",
                 "detail": f"llama.cpp {llama_cpp.__version__}"
                 + (", GPU offload available" if gpu else ", CPU build")}]
    if backend == "onnx":
        if importlib.util.find_spec("onnxruntime_genai") is None:
            return []
        from spececd.backends import onnx

        return onnx.devices()
    if backend == "openvino":
        if importlib.util.find_spec("openvino") is None:
            return []
        from spececd.backends import openvino

        return openvino.devices()
    raise ValueError(f"unknown backend {backend!r}")


def available_devices() -> list[dict[str, str]]:
    """Every device a model can run on here, with the backend that uses it."""
    return [device for backend in ("hf", "llama.cpp", "onnx", "openvino")
            for device in backend_devices(backend)]


def has_npu(backend: str) -> bool:
    """Whether ``backend``'s runtime finds a neural processing unit here."""
    return any(is_npu(device) for device in backend_devices(backend))
