"""Pick a backend for a model spec. Backends are imported only when used.

- a path ending in ``.gguf`` (or ``backend="llama.cpp"``): llama.cpp;
- anything else (a local folder or a hub id): Hugging Face transformers on PyTorch.
"""

from __future__ import annotations

import importlib.util

from spececd.backends.base import Backend, Tokenizer
from spececd.errors import InputError

BACKENDS = ("hf", "llama.cpp")


def load_backend(model: str, device: str = "auto", dtype: str = "auto",
                 backend: str = "auto", threads: int = 0) -> Backend:
    """Load ``model`` (a local folder, a hub id or a GGUF file) with the named backend.
    For llama.cpp, ``device`` other than cpu offloads every layer to the build's GPU."""
    if backend not in ("auto", *BACKENDS):
        raise InputError(f"unknown backend {backend!r}: use one of auto, {', '.join(BACKENDS)}")
    if backend == "llama.cpp" or (backend == "auto" and model.lower().endswith(".gguf")):
        from spececd.backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend(model, n_threads=threads,
                               n_gpu_layers=0 if device in ("cpu", "auto") else -1)
    if not all(importlib.util.find_spec(name) for name in ("torch", "transformers")):
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
    return devices
