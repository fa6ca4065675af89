"""Device discovery: which devices each installed runtime can run a model on here.

``spececd devices`` lists :func:`available_devices`; :func:`has_npu` says whether a
backend's runtime sees a neural processing unit, which the registry asks when a user
writes ``--device npu``. Each runtime is asked only when it is installed, and through its
own backend module (which alone imports it, and is imported here only then); this module
imports no runtime itself and loads no model.
"""

from __future__ import annotations

import importlib
import importlib.util


def is_npu(device: dict[str, str]) -> bool:
    """Whether an entry of :func:`available_devices` is a neural processing unit."""
    return device["device"] == "qnn" or device["device"].split(".")[0] == "npu"


# Each backend: the module its runtime is found by, and its module's device listing.
_LISTINGS = {"hf": ("torch", "hf", "available_devices"),
             "llama.cpp": ("llama_cpp", "llamacpp", "devices"),
             "onnx": ("onnxruntime_genai", "onnx", "devices"),
             "openvino": ("openvino", "openvino", "devices")}


def backend_devices(backend: str) -> list[dict[str, str]]:
    """The devices ``backend``'s runtime can run a model on here (none when it is not
    installed), each ``{"device", "backend", "detail"}``."""
    runtime, module, listing = _LISTINGS[backend]
    if importlib.util.find_spec(runtime) is None:
        return []
    devices: list[dict[str, str]] = getattr(
        importlib.import_module(f"spececd.backends.{module}"), listing)()
    return devices


def available_devices() -> list[dict[str, str]]:
    """Every device a model can run on here, with the backend that uses it."""
    return [device for backend in _LISTINGS for device in backend_devices(backend)]


def has_npu(backend: str) -> bool:
    """Whether ``backend``'s runtime finds a neural processing unit here."""
    return any(is_npu(device) for device in backend_devices(backend))
