"""OpenVINO: model folders with an ``openvino_model.xml``, on OpenVINO's ``CPU``, ``GPU``
(Intel integrated and Arc) or ``NPU`` (Intel Core Ultra) device.

The folder is the layout optimum-intel writes (``OVModelForCausalLM``), and
``spececd convert --to openvino`` writes the same: a **stateful** model whose inputs are
``input_ids``, ``attention_mask`` and ``position_ids`` (and ``beam_idx`` in optimum-intel's
exports), whose output is ``logits`` for every new position, and whose KV cache lives in
the infer request as one state variable per layer's keys and values, ``[1, heads,
tokens, dim]``. The KV cache stays in OpenVINO's memory between steps, which is what keeps
a step fast (an export with the cache as inputs and outputs copied it in and out every
step: 8.4 ms against 2.1 ms per token for the default draft at 400 tokens of context).

Rollback therefore rewrites the states: ``truncate(n)`` sets each state to its first ``n``
positions (a copy of the kept part, once per round on the edge). Each
:class:`OpenVinoSequence` is one infer request of the one compiled model. Chains only.

On the CPU the model runs in float32, its KV cache too (OpenVINO would pick bfloat16 on
CPUs that have it, and a u8 KV cache where its attention kernel holds the cache); on GPU
and NPU at the device's defaults (f16). ``--device`` takes OpenVINO's device names in
lower case: ``cpu``, ``gpu``, ``gpu.1``, ``npu``.

``spececd convert --to openvino`` exports with OpenVINO's own converter
(``openvino.convert_model`` over the transformers model, then the same stateful
transformation optimum-intel applies) and compresses weights to int8 or int4 with NNCF.
optimum-intel itself is not used: its releases pin transformers below 5.6 (and torchvision),
which cannot be installed next to vLLM's transformers >= 5.16.

This module is the only one that imports openvino.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from spececd.backends.base import Backend, ChainSequence
from spececd.errors import InputError

MODEL = "openvino_model.xml"
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
# rotary embeddings that branch on the sequence length in Python (tracing fixes one branch)
TRACE_DEPENDENT_ROPE = ("dynamic", "longrope")


def is_model_folder(path: Path) -> bool:
    return (path / MODEL).is_file()


def _core() -> Any:
    try:
        import openvino as ov
    except ImportError:
        raise InputError("OpenVINO model folders need the OpenVINO backend: "
                         "pip install 'spececd[openvino]'") from None
    return ov.Core()


def devices() -> list[dict[str, str]]:
    """OpenVINO's devices here (``CPU``, ``GPU``, ``GPU.1``, ``NPU``), by our names."""
    import openvino as ov

    core = ov.Core()
    found = []
    for name in core.available_devices:
        full = str(core.get_property(name, "FULL_DEVICE_NAME"))
        found.append({"device": name.lower(), "backend": "openvino",
                      "detail": f"OpenVINO {ov.__version__.split('-')[0]}, {full}"})
    return found


class OpenVinoSequence(ChainSequence):
    runtime = "OpenVINO"

    def __init__(self, backend: OpenVinoBackend) -> None:
        super().__init__(backend.vocab_size, backend.max_context)
        self._backend = backend
        self._request = backend.compiled.create_infer_request()
        self._states = {state.name: state for state in self._request.query_state()}
        self._rollback(0)

    def _rollback(self, n: int) -> None:
        import openvino as ov

        for name, state in self._states.items():
            if n == 0:  # empty, in the state's own precision (f16 on GPU and NPU)
                heads, dim = self._backend.kv_shapes[name]
                dtype = state.state.get_element_type().to_dtype()
                kept = np.zeros((1, heads, 0, dim), dtype=dtype)
            else:
                kept = np.ascontiguousarray(state.state.data[:, :, :n])
            state.state = ov.Tensor(kept)

    def _run(self, ids: list[int], keep: int) -> np.ndarray:
        start, n = len(self._tokens), len(ids)
        inputs = {"input_ids": np.asarray([ids], dtype=np.int64),
                  "attention_mask": np.ones((1, start + n), dtype=np.int64),
                  "position_ids": np.arange(start, start + n, dtype=np.int64)[None]}
        if self._backend.beam_idx:
            inputs["beam_idx"] = np.zeros(1, dtype=np.int32)
        return np.asarray(self._request.infer(inputs)["logits"][0])  # [n, logits width]


class OpenVinoBackend(Backend):
    name = "openvino"

    def __init__(self, folder: str, device: str = "cpu", threads: int = 0) -> None:
        core = _core()
        path = Path(folder).expanduser()
        target = device.upper()  # OpenVINO's name: CPU, GPU, GPU.1, NPU
        if target not in core.available_devices:
            raise InputError(f"OpenVINO has no device {device!r} here; it has "
                             f"{', '.join(d.lower() for d in core.available_devices)} "
                             "(`spececd devices` lists them)")
        model = core.read_model(str(path / MODEL))
        names = {name for port in model.inputs for name in port.get_names()}
        missing = {"input_ids", "attention_mask", "position_ids"} - names
        if missing or "logits" not in {n for port in model.outputs for n in port.get_names()}:
            raise InputError(f"{folder!r} is not a stateful causal LM export (no "
                             f"{', '.join(sorted(missing)) or 'logits output'}): export it "
                             "with `spececd convert --to openvino` or optimum-intel")
        self.beam_idx = "beam_idx" in names
        self.kv_shapes: dict[str, tuple[int, int]] = {}  # state: (KV heads, head dim)
        for op in model.get_ops():
            if op.get_type_name() == "ReadValue":
                shape = op.get_output_partial_shape(0)
                self.kv_shapes[op.get_variable_id()] = (shape[1].get_length(),
                                                        shape[3].get_length())
        if not self.kv_shapes:
            raise InputError(f"{folder!r} keeps no KV cache in states (a stateless export): "
                             "export it with `spececd convert --to openvino`")
        properties: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
        if target == "CPU":  # float32 throughout: OpenVINO would pick bf16 and a u8 KV cache
            properties.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
            if threads:
                properties["INFERENCE_NUM_THREADS"] = threads
        try:
            self.compiled: Any = core.compile_model(model, target, properties)
        except RuntimeError as exc:
            hint = "" if target == "CPU" else (
                "; run it on the cpu (--device cpu, or npu = false in config.toml)")
            raise InputError(f"OpenVINO could not compile {folder!r} for {target}: "
                             f"{str(exc).strip().splitlines()[-1]}{hint}") from None
        # one state per layer's keys and another for its values, each in its precision
        request = self.compiled.create_infer_request()
        itemsize = {state.name: state.state.get_element_type().size
                    for state in request.query_state()}
        self.kv_bytes_per_token = sum(heads * dim * itemsize[name]
                                      for name, (heads, dim) in self.kv_shapes.items())
        config = json.loads((path / "config.json").read_text()) \
            if (path / "config.json").is_file() else {}
        self.max_context = int(config.get("max_position_embeddings", 2048))
        from spececd.backends.hf_tokenizer import load_tokenizer

        self.tokenizer, vocab = load_tokenizer(str(path))
        width = self.compiled.output("logits").get_partial_shape()[2]
        self.vocab_size = min(vocab, width.get_length()) if width.is_static else vocab
        self.device = device
        self.description = f"{path.name} (OpenVINO, {target})"

    def new_sequence(self) -> OpenVinoSequence:
        return OpenVinoSequence(self)


def export(model_dir: Path, out: Path, weight_format: str = "fp32") -> Path:
    """A transformers folder to a stateful OpenVINO folder (see the module docstring)."""
    if weight_format not in WEIGHT_FORMATS:
        raise InputError(f"--weight-format takes {', '.join(WEIGHT_FORMATS)}, "
                         f"not {weight_format!r}")
    try:
        import openvino as ov
        import torch
        from openvino._offline_transformations import apply_make_stateful_transformation
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise InputError("converting to OpenVINO needs torch, transformers and openvino: "
                         "pip install torch==2.13.0 'spececd[hf,openvino]'") from None
    from spececd.convert import require_model_folder

    require_model_folder(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rope = (getattr(model.config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in TRACE_DEPENDENT_ROPE:
        raise InputError(f"{model_dir} uses {rope!r} rotary embeddings, which choose their "
                         "frequencies by sequence length in Python: a traced export would "
                         "keep one choice for every length. Draft with the transformers or "
                         "ONNX backend instead")
    wrapper, example, shapes = _traceable(model.eval())
    with torch.no_grad(), warnings.catch_warnings():
        # tracing notes every Python branch it fixes; the export is checked against
        # transformers over varied lengths instead (tests/backends/test_onnx_openvino.py)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # type: ignore[attr-defined]
        # OpenVINO converts a torch module by tracing it (TorchScript), which torch 2.13
        # deprecates; it still works, and the check above is what vouches for the result
        warnings.filterwarnings("ignore", r"`torch\.jit\.trace", DeprecationWarning)
        converted = ov.convert_model(wrapper, example_input=example)
    layers = len(shapes)
    names = ["input_ids", "position_ids", "attention_mask",
             *(f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))]
    outputs = ["logits", *(f"present.{i}.{kind}" for i in range(layers)
                           for kind in ("key", "value"))]
    for port, name in zip(converted.inputs, names, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(converted.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    converted.reshape({name: ov.PartialShape([-1, heads, -1, dim]) for name, (heads, dim)
                       in zip(names[3:], (s for s in shapes for _ in range(2)), strict=True)})
    apply_make_stateful_transformation(converted, dict(zip(names[3:], outputs[1:], strict=True)))
    if weight_format in ("int8", "int4"):
        converted = _compress(converted, weight_format)
    out.mkdir(parents=True, exist_ok=True)
    ov.save_model(converted, str(out / MODEL), compress_to_fp16=weight_format == "fp16")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


def _traceable(model: Any) -> tuple[Any, tuple[Any, ...], list[tuple[int, int]]]:
    """A module taking ``(input_ids, position_ids, attention_mask, *past)`` with the KV cache
    as plain tensors, an example input for tracing, and each layer's (KV heads, head dim).
    Refuses caches other than plain full-attention layers (sliding windows would need
    their own rollback)."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from spececd.backends.hf import cache_keyword

    keyword = cache_keyword(model)
    with torch.no_grad():
        probe = model(input_ids=torch.tensor([[0, 1]]), use_cache=True)[keyword]
    layers: list[Any] = list(probe.layers) if isinstance(probe, DynamicCache) else []
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        raise InputError(f"{model.config.model_type} keeps a KV cache other than plain "
                         "attention layers (sliding windows, recurrent state): the OpenVINO "
                         "export covers full-attention decoders only")
    shapes = [(int(layer.keys.shape[1]), int(layer.keys.shape[3])) for layer in layers]
    if any(layer.values.shape[1:4:2] != layer.keys.shape[1:4:2] for layer in layers):
        raise InputError("keys and values of different shapes are not supported")

    class WithPlainCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, position_ids: Any, attention_mask: Any,
                    *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache(config=self.model.config)
            layer: Any
            for i, layer in enumerate(cache.layers):
                # set, not update(): update() starts from an empty 1-D tensor, which
                # OpenVINO cannot concatenate with the 4-D past
                layer.dtype, layer.device = past[2 * i].dtype, past[2 * i].device
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.is_initialized = True
            out = self.model(input_ids=input_ids, position_ids=position_ids,
                             attention_mask=attention_mask, use_cache=True,
                             **{keyword: cache})
            present = out[keyword].layers
            return (out.logits, *(t for layer in present for t in (layer.keys, layer.values)))

    cached, new = 3, 2
    example = (torch.tensor([[1, 2]]), torch.tensor([[cached, cached + 1]]),
               torch.ones(1, cached + new, dtype=torch.long),
               *(torch.zeros(1, heads, cached, dim) for heads, dim in shapes for _ in range(2)))
    return WithPlainCache(), example, shapes


def _compress(model: Any, weight_format: str) -> Any:
    try:
        import nncf
    except ImportError:
        raise InputError("int8 and int4 weights need NNCF: pip install 'spececd[openvino]'"
                         ) from None
    if weight_format == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=64,
                                 ratio=1.0)
