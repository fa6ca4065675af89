"""``--dtype auto`` (spececd.backends.dtypes): the model's own dtype where the device computes
it natively, float32 elsewhere, read from the CPU's flags; and the same rule where a model
loads (the backend's dtype and the reason it gives)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spececd.backends.dtypes import auto_dtype, cpu_computes_bf16, cpu_flags, stored_dtype

XEON = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n"


def test_the_cpus_flags_are_read_and_name_bfloat16_where_it_has_it() -> None:
    assert "avx512_bf16" in cpu_flags(XEON)
    assert not cpu_computes_bf16(cpu_flags(XEON))  # AVX512-BF16 alone: float32 is faster
    assert cpu_computes_bf16(cpu_flags(XEON.replace("amx_tile", "amx_tile amx_bf16")))
    assert not cpu_computes_bf16(cpu_flags("flags : fpu sse avx2 avx512f\n"))
    assert cpu_flags("no flags here") == frozenset()


@pytest.mark.parametrize("stored,device,native,chosen", [
    ("bfloat16", "cpu", True, "bfloat16"),
    ("bfloat16", "cpu", False, "float32"),  # said so where it loads
    ("float16", "cpu", True, "float32"),  # float16 on a CPU: emulated by most kernels
    ("float32", "cpu", True, "float32"),
    (None, "cpu", True, "float32"),
    ("bfloat16", "cuda", True, "bfloat16"),
    ("bfloat16", "cuda", False, "float16"),  # a GPU without bfloat16
    ("float16", "cuda", True, "float16"),
    ("float32", "cuda", True, "bfloat16"),  # a float32 checkpoint in half on a GPU (vLLM)
    ("float32", "mps", False, "float16"),
])
def test_auto_is_the_models_own_dtype_where_the_device_computes_it(
        stored: str | None, device: str, native: bool, chosen: str) -> None:
    assert auto_dtype(stored, device, native) == chosen


def test_the_stored_dtype_is_read_from_either_name_in_the_config() -> None:
    assert stored_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert stored_dtype({"torch_dtype": "float16"}) == "float16"
    assert stored_dtype({}) is None


def test_a_model_loads_in_the_dtype_auto_chooses_and_says_why(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from spececd.backends.hf import HFBackend

    folder = tmp_path / "bf16"
    folder.mkdir()
    for file in tiny_models["llama"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    backend = HFBackend(str(folder), device="cpu", dtype="auto", threads=1)
    native = cpu_computes_bf16()
    assert backend.model.dtype == (torch.bfloat16 if native else torch.float32)
    assert ("the model's own" if native else "does not compute") in backend.dtype_reason
    fp32 = HFBackend(str(tiny_models["llama"]), device="cpu", dtype="auto", threads=1)
    assert fp32.model.dtype == torch.float32 and "the model's own" in fp32.dtype_reason
