"""`spececd convert --to gguf`: a transformers model folder to a GGUF file for llama.cpp.

It runs llama.cpp's own converter (``convert_hf_to_gguf.py`` with its vendored ``gguf``
library), taken from the source distribution of the installed ``llama-cpp-python``
(downloaded once with pip and cached under ``~/.cache/spececd``; or point
``SPECECD_LLAMA_CPP_SRC`` at a ``vendor/llama.cpp`` folder). Types the converter writes
itself (``f32``, ``f16``, ``bf16``, ``q8_0``) come straight from it; k-quants such as
``q4_k_m`` are made from an ``f16`` file by llama.cpp's quantizer through the
``llama_cpp`` library.

The converter names a BPE pre-tokenizer by hashing how the tokenizer splits a test text,
so it does not know a tokenizer trained here. When that lookup fails, the tokenizer's own
definition is read: a plain GPT-2 byte-level pre-tokenizer (``ByteLevel`` with GPT-2's
regex, as the default pair uses) is registered as llama.cpp's ``gpt-2``; anything else is
refused rather than guessed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from spececd.errors import InputError

log = logging.getLogger(__name__)

CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZER_TYPES = {  # llama.cpp's LLAMA_FTYPE_MOSTLY_* values
    "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12,
    "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18,
}

_BOOTSTRAP = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if pre:
            return pre
        raise
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def pre_tokenizer_name(model_dir: Path) -> str:
    """llama.cpp's name for the model's pre-tokenizer when we can tell it from its
    definition, else ''."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return ""
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) \
            and not pre.get("add_prefix_space", False):
        return "gpt-2"
    return ""


def llama_cpp_source() -> Path:
    """The ``vendor/llama.cpp`` folder of the installed llama-cpp-python's sdist."""
    env = os.environ.get("SPECECD_LLAMA_CPP_SRC")
    if env:
        return Path(env)
    try:
        from importlib.metadata import version

        installed = version("llama-cpp-python")
    except Exception:
        raise InputError("converting to GGUF needs llama-cpp-python: "
                         "pip install 'spececd[llama]'") from None
    cache = Path.home() / ".cache" / "spececd" / f"llama.cpp-{installed}"
    if (cache / "convert_hf_to_gguf.py").is_file():
        return cache
    with tempfile.TemporaryDirectory() as tmp:
        log.warning("fetching llama-cpp-python %s's source for its converter (once)", installed)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={installed}", "-d", tmp],
                       check=True, capture_output=True)
        (archive,) = Path(tmp).glob("*.tar.gz")
        prefix = f"llama_cpp_python-{installed}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (
                m.name.startswith(prefix + "conversion/") or
                m.name.startswith(prefix + "gguf-py/") or
                m.name == prefix + "convert_hf_to_gguf.py")]
            for member in members:
                member.name = member.name[len(prefix):]
            cache.mkdir(parents=True, exist_ok=True)
            tar.extractall(cache, members=members, filter="data")
    return cache


def require_model_folder(model_dir: Path) -> None:
    """What every conversion starts from: a folder saved with ``save_pretrained``."""
    if not (model_dir / "config.json").is_file():
        raise InputError(f"{model_dir} is not a transformers model folder (no config.json)")


def convert(model_dir: Path, out: Path, quant: str = "f16") -> Path:
    quant = quant.lower()
    if quant not in CONVERTER_TYPES and quant not in QUANTIZER_TYPES:
        raise InputError(f"unknown --quant {quant!r}: use one of "
                         f"{', '.join([*CONVERTER_TYPES, *QUANTIZER_TYPES])}")
    require_model_folder(model_dir)
    src = llama_cpp_source()
    base = out if quant in CONVERTER_TYPES else out.with_suffix(".f16.tmp.gguf")
    result = subprocess.run(
        [sys.executable, "-c", _BOOTSTRAP, str(src), pre_tokenizer_name(model_dir),
         str(model_dir), "--outfile", str(base),
         "--outtype", quant if quant in CONVERTER_TYPES else "f16"],
        capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise InputError(f"llama.cpp's converter failed on {model_dir}:\n{tail}")
    if quant in QUANTIZER_TYPES:
        try:
            quantize(base, out, QUANTIZER_TYPES[quant])
        finally:
            base.unlink(missing_ok=True)
    return out


def quantize(source: Path, out: Path, ftype: int) -> None:
    import llama_cpp

    from spececd.backends.llamacpp import _quiet_llama_logs

    _quiet_llama_logs()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if status != 0:
        raise InputError(f"llama.cpp's quantizer failed on {source} (status {status})")
