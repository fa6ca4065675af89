"""ONNX Runtime GenAI: model folders with a ``genai_config.json``, as onnxruntime-genai's
own model builder writes them (``spececd convert --to onnx``: fp32, int8 or int4).
Models split into a pipeline of several ONNX files (type ``decoder-pipeline``, the form of
the QNN models vendors ship for Snapdragon NPUs) are refused: onnxruntime-genai cannot
rewind their KV cache.

Each :class:`OnnxSequence` owns one ``og.Generator`` (one KV cache); the loaded model, and
so the weights, are shared. ``extend`` appends tokens and reads the model's ``logits``
output, which holds every new position; ``truncate`` is the generator's ``rewind_to``.
Chains only: the builder's models build their causal mask inside (no token trees).

The builder's models share one KV buffer between past and present (its
``past_present_share_buffer``), so a sequence reserves its whole context
(``max_context`` positions) when it is made, as a llama.cpp context does.
``kv_bytes_per_token`` is measured once at load, from the KV output of a one-token pass.

The execution provider comes from the device, replacing those the folder names: ``cpu``
(ONNX Runtime's default), ``cuda``, ``dml`` (DirectML) or ``qnn`` (Qualcomm's NPU), where
the installed build has them (:func:`devices` lists them); the registry resolves ``npu``
and ``auto`` (the CPU).

The tokenizer is the transformers tokenizer the builder saves in the folder.

This module is the only one that imports onnxruntime_genai.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from spececd.backends.base import Backend, ChainSequence
from spececd.errors import InputError

CONFIG = "genai_config.json"
# device -> (ONNX Runtime's provider name, onnxruntime-genai's name for it); cpu has none
PROVIDERS = {"cuda": ("CUDAExecutionProvider", "cuda"), "dml": ("DmlExecutionProvider", "dml"),
             "qnn": ("QNNExecutionProvider", "QNN")}
# the model type whose KV cache onnxruntime-genai cannot rewind (models split into several
# ONNX files, as QNN NPU models are)
PIPELINE = "decoder-pipeline"
# what the builder writes for a CPU (the precisions it offers there)
PRECISIONS = ("fp32", "int8", "int4")


def is_model_folder(path: Path) -> bool:
    return (path / CONFIG).is_file()


def devices() -> list[dict[str, str]]:
    """The devices this ONNX Runtime build can run a model on."""
    import onnxruntime
    import onnxruntime_genai as og

    available = set(onnxruntime.get_available_providers())
    found = [{"device": "cpu", "backend": "onnx",
              "detail": f"onnxruntime-genai {og.__version__}, CPUExecutionProvider"}]
    for device, (provider, _) in PROVIDERS.items():
        if provider in available:
            kind = "NPU" if device == "qnn" else "GPU"
            found.append({"device": device, "backend": "onnx", "detail": f"{provider} ({kind})"})
    return found


class OnnxSequence(ChainSequence):
    runtime = "ONNX Runtime"

    def __init__(self, backend: OnnxBackend, max_length: int = 0) -> None:
        import onnxruntime_genai as og

        super().__init__(backend.vocab_size, backend.max_context)
        params = og.GeneratorParams(backend.model)
        params.set_search_options(max_length=max_length or backend.max_context)
        self._generator = og.Generator(backend.model, params)

    def _run(self, ids: list[int], keep: int) -> np.ndarray:
        self._generator.append_tokens(np.asarray(ids, dtype=np.int32))
        logits: np.ndarray = np.asarray(self._generator.get_output("logits"))[0]
        return logits  # [n, logits width]

    def _rollback(self, n: int) -> None:
        self._generator.rewind_to(n)


class OnnxBackend(Backend):
    name = "onnx"

    def __init__(self, folder: str, device: str = "cpu", threads: int = 0) -> None:
        try:
            import onnxruntime_genai as og
        except ImportError:
            raise InputError("ONNX model folders need the ONNX Runtime GenAI backend: "
                             "pip install 'spececd[onnx]'") from None
        path = Path(folder).expanduser()
        settings = json.loads((path / CONFIG).read_text())["model"]
        if settings.get("type") == PIPELINE:
            raise InputError(f"{folder!r} is a {PIPELINE} model: onnxruntime-genai cannot "
                             "rewind its KV cache, which drafting needs; use a model written "
                             "by its builder (`spececd convert --to onnx`)")
        config = og.Config(str(path))
        config.clear_providers()
        if device != "cpu":
            if device not in PROVIDERS:
                raise InputError(f"the ONNX Runtime backend runs on cpu, "
                                 f"{', '.join(PROVIDERS)} or npu, not {device!r}")
            config.append_provider(PROVIDERS[device][1])
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": threads}}}}))
        try:
            self.model: Any = og.Model(config)
        except Exception as exc:  # onnxruntime-genai raises plain RuntimeErrors
            raise InputError(f"ONNX Runtime GenAI could not load {folder!r} on {device}: "
                             f"{exc}" + ("; try --device cpu" if device != "cpu" else "")
                             ) from None
        self.max_context = int(settings["context_length"])
        from spececd.backends.hf_tokenizer import load_tokenizer

        # The generation config's end tokens when the folder has one (an export copies
        # it), as for the transformers model; else the builder's genai_config.json.
        eos = [] if (path / "generation_config.json").is_file() else \
            settings.get("eos_token_id", [])
        self.tokenizer, vocab = load_tokenizer(str(path), tuple(
            int(e) for e in (eos if isinstance(eos, list) else [eos])))
        self.vocab_size = min(vocab, int(settings["vocab_size"]))
        self.kv_bytes_per_token = self._measure_kv(settings["decoder"])
        self.device = device
        self.description = f"{path.name} (onnxruntime-genai {og.__version__}, {device})"

    def _measure_kv(self, decoder: dict[str, Any]) -> int:
        """Bytes per token of every layer's keys and values, from a one-token pass of a
        two-position generator (its KV outputs are ``[1, heads, 2, dim]``)."""
        probe = OnnxSequence(self, max_length=2)
        probe.extend([0], keep=0)
        names = decoder["outputs"]
        return sum(np.asarray(probe._generator.get_output(names[kind] % i)).nbytes // 2
                   for i in range(int(decoder["num_hidden_layers"]))
                   for kind in ("present_key_names", "present_value_names"))

    def new_sequence(self) -> OnnxSequence:
        return OnnxSequence(self)


def export(model_dir: Path, out: Path, precision: str = "fp32") -> Path:
    """A transformers folder to an ONNX Runtime GenAI folder, with onnxruntime-genai's own
    model builder, for the CPU execution provider (fp32, int8 or int4 weights)."""
    from spececd.convert import require_model_folder

    require_model_folder(model_dir)
    if precision not in PRECISIONS:
        raise InputError(f"--quant for ONNX takes {', '.join(PRECISIONS)}, not {precision!r}")
    missing = [name for name in ("onnxruntime_genai", "onnx", "onnx_ir", "torch", "transformers")
               if not _importable(name)]
    if missing:
        raise InputError(f"converting to ONNX needs {', '.join(missing)}: "
                         "pip install torch==2.13.0 'spececd[hf,onnx]'")
    config = json.loads((model_dir / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_size % 16:
        raise InputError(f"{model_dir} has attention heads of {head_size} dimensions: ONNX "
                         "Runtime's GroupQueryAttention, which the builder's models use, "
                         "needs a multiple of 16")
    result = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(model_dir),
         "-i", str(model_dir), "-o", str(out), "-p", precision, "-e", "cpu"],
        capture_output=True, text=True, check=False)
    if result.returncode != 0 or not is_model_folder(out):
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise InputError(f"onnxruntime-genai's model builder failed on {model_dir}:\n{tail}")
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        shutil.copy(generation, out / generation.name)
    return out


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
