"""Pick a backend for a model spec. Backends are imported only when used."""

from __future__ import annotations

import importlib.util

from spececd.backends.base import Backend
from spececd.errors import InputError

BACKENDS = ("hf",)


def load_backend(model: str, device: str = "auto", dtype: str = "auto",
                 backend: str = "auto") -> Backend:
    """Load ``model`` (a local folder or a hub id) with the named backend."""
    if backend not in ("auto", *BACKENDS):
        raise InputError(f"unknown backend {backend!r}: use one of auto, {', '.join(BACKENDS)}")
    if not all(importlib.util.find_spec(name) for name in ("torch", "transformers")):
        raise InputError("the Hugging Face backend needs torch and transformers: "
                         "pip install torch==2.13.0 'spececd[hf]'")
    from spececd.backends.hf import HFBackend

    return HFBackend(model, device=device, dtype=dtype)


def available_devices() -> list[dict[str, str]]:
    devices: list[dict[str, str]] = []
    if importlib.util.find_spec("torch") is not None:
        from spececd.backends import hf

        devices.extend(hf.available_devices())
    return devices
