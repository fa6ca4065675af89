"""Hugging Face transformers on PyTorch: any causal LM from a local folder or a hub id.

Loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` on ``cpu``, ``cuda``, ``mps`` or
``auto`` (the best available; a requested device that is missing falls back to the CPU
with a one-line warning). Each :class:`HFSequence` owns a ``DynamicCache``; rollback is
``DynamicCache.crop`` (transformers 5: a negative count of tokens to remove).

Every model of this runtime in the process that runs on several torch threads, draft and
target alike, loads and runs on one thread (:func:`torch_thread`, a
:class:`~spececd.backends.base.ModelThread`): torch's OpenMP workers then form one team,
which keeps its forward passes as fast as when one thread calls them. A model on one torch
thread has no team, so it gets a thread of its own (:func:`model_thread`): a draft and a
target of one thread each then run side by side on two cores, a draft step beside a
verification pass of another session.

This module and the runner's paged path (:mod:`spececd.backends.paged`) are the only ones that
import torch and transformers for inference.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from spececd.backends.base import (
    Backend,
    CachedSequence,
    Extend,
    ModelThread,
    contiguous,
    is_chain,
    on_model_thread,
    resolve_keep,
    tree_layout,
)
from spececd.backends.dtypes import CPU_BF16_FLAGS, auto_dtype, cpu_flags, stored_dtype
from spececd.backends.hf_tokenizer import HFTokenizer, eos_token_ids
from spececd.backends.startup import lean_transformers
from spececd.errors import InputError

lean_transformers()  # before transformers loads: in SpecECD's own processes, no SciPy, scikit-learn
# Imported here, at import time: transformers' lazy attributes are not thread-safe on first
# use (models load on the torch thread only, see torch_thread).
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

log = logging.getLogger(__name__)
_THREAD_LOCK = threading.Lock()

_THREAD: ModelThread | None = None


def torch_thread() -> ModelThread:
    """The thread this process runs its transformers models on, made on first use."""
    global _THREAD
    if _THREAD is not None:
        return _THREAD
    with _THREAD_LOCK:
        if _THREAD is None:
            _THREAD = ModelThread("spececd-torch")
        return _THREAD


def model_thread(threads: int) -> ModelThread:
    """The thread a model of ``threads`` torch threads (0: the process's count) loads and
    runs on: a new one of its own for one thread, else :func:`torch_thread`."""
    if (threads or torch.get_num_threads()) == 1:
        return ModelThread("spececd-torch-1")
    return torch_thread()




DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def available_devices() -> list[dict[str, str]]:
    """Every device torch can use here, with a short description."""
    devices = [{"device": "cpu", "backend": "hf", "detail": f"{torch.get_num_threads()} threads"}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"device": f"cuda:{i}", "backend": "hf",
                            "detail": f"{props.name}, {props.total_memory / 2**30:.0f} GiB"})
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append({"device": "mps", "backend": "hf", "detail": "Apple Metal"})
    return devices


def resolve_device(device: str) -> torch.device:
    """Map ``auto``/``cpu``/``cuda[:i]``/``mps`` to a usable device, warning on fallback."""
    mps_ok = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if mps_ok else "cpu")
    if device.startswith("cuda"):
        if torch.cuda.is_available():
            return torch.device(device)
        log.warning("device %s requested but CUDA is not available; falling back to cpu", device)
        return torch.device("cpu")
    if device == "mps":
        if mps_ok:
            return torch.device("mps")
        log.warning("device mps requested but Metal is not available; falling back to cpu")
        return torch.device("cpu")
    if device == "cpu":
        return torch.device("cpu")
    raise InputError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps "
                     f"(`spececd devices` lists what is usable here)")


def resolve_dtype(dtype: str, device: torch.device, model: str | None = None) -> torch.dtype:
    """The torch dtype ``dtype`` names for ``model`` (a folder or hub id) on ``device``
    (``auto``: :mod:`spececd.backends.dtypes`)."""
    return choose_dtype(dtype, device, model)[0]


def choose_dtype(dtype: str, device: torch.device, model: str | None = None
                 ) -> tuple[torch.dtype, str]:
    """:func:`resolve_dtype`, and why, in words (the commands' first line says it)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise InputError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
        return DTYPES[dtype], f"{dtype} (asked for)"
    stored = model_dtype(model) if model is not None else None
    if device.type == "cpu":
        flags = sorted(cpu_flags() & set(CPU_BF16_FLAGS))
        native = bool(flags)
    else:
        flags = []
        # Computed, not emulated (a T4 or V100 emulates it; vLLM refuses it there); Metal
        # kept bfloat16 before this rule, and keeps it.
        native = device.type == "mps" or (device.type == "cuda" and torch.cuda.is_bf16_supported(
            including_emulation=False))
    chosen = auto_dtype(stored, device.type, native)
    if chosen == (stored or "float32"):
        why = f"{chosen}, the model's own" + (
            f" (this CPU computes it: {', '.join(flags)})" if flags and chosen != "float32"
            else "")
    elif device.type == "cpu":
        why = (f"float32: the model is stored in {stored}, which this CPU does not compute "
               f"faster (no {' or '.join(CPU_BF16_FLAGS)}); --dtype {stored} runs it so")
    else:
        why = f"{chosen}: the model's {stored or 'float32'} in half precision on {device.type}"
    return DTYPES[chosen], why


def model_dtype(model: str) -> str | None:
    """The dtype ``model``'s weights are stored in, as its config says (None: it does not
    say, or the config cannot be read here)."""
    folder = Path(model).expanduser()
    try:
        if folder.is_dir():
            return stored_dtype(json.loads((folder / "config.json").read_text()))
        return stored_dtype(AutoConfig.from_pretrained(model).to_dict())
    except (OSError, ValueError):
        return None


def _load(source: str, dtype: torch.dtype, device: torch.device,
          threads: int) -> tuple[Any, Any]:
    """The model, on ``device`` in inference mode, and its transformers tokenizer. Runs on
    the torch thread. With OpenMP the thread count is the calling thread's own: measured
    here, after torch.set_num_threads(1) on the main thread, a matmul on another thread ran
    on both cores while torch.get_num_threads() there said 1. So it is set here, on the
    thread that runs the models."""
    torch.set_num_threads(threads or torch.get_num_threads())
    model = cast(Any, AutoModelForCausalLM.from_pretrained(source, dtype=dtype))
    return model.to(device).eval(), AutoTokenizer.from_pretrained(source)


def cache_keyword(model: Any) -> str:
    """The name ``model``'s forward takes and returns its KV cache by: ``cache`` where
    transformers has renamed it (5.24 has, and warns on every call that uses the old name:
    a FutureWarning in, a log line out), else ``past_key_values`` (5.19, vLLM's pin). Read
    from the signature rather than the version: the model's own code decides."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class HFSequence:
    def __init__(self, backend: HFBackend) -> None:
        self._backend = backend
        self._tokens: list[int] = []
        self._cache = self._new_cache()

    def _new_cache(self) -> Any:
        return DynamicCache(config=self._backend.model.config)

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def thread(self) -> ModelThread:
        return self._backend.thread

    @on_model_thread
    @torch.inference_mode()
    def extend(self, ids: Sequence[int], keep: int | None = None,
               parents: Sequence[int] | None = None) -> np.ndarray:
        n, keep = len(ids), resolve_keep(len(ids), keep)
        if n == 0:
            return np.zeros((0, self._backend.vocab_size), dtype=np.float32)
        start = len(self._tokens)
        device = self._backend.device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        positions = torch.arange(start, start + n, device=device)
        position_ids, mask = positions[None, :], None
        if not is_chain(parents):
            assert parents is not None
            visible, depth = tree_layout(parents)
            position_ids = torch.tensor(start + depth - 1, device=device)[None, :]
            allowed = torch.ones((1, n, start + n), dtype=torch.bool, device=device)
            allowed[0, :, start:] = torch.from_numpy(visible)
            mask = self._backend.additive(allowed)
        logits, self._cache = self._backend.forward(
            self._cache, input_ids=input_ids, attention_mask=mask, cache_position=positions,
            position_ids=position_ids, logits_to_keep=max(keep, 1))
        self._tokens.extend(int(t) for t in ids)
        if keep == 0:
            return np.zeros((0, self._backend.vocab_size), dtype=np.float32)
        return self._backend.valid(logits[0, -keep:])

    def _set_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cache = self._new_cache()
        for index, (keys, values) in enumerate(layers):
            # A copy of its own (transformers' DynamicLayer.update concatenates onto an
            # empty tensor): never a view of the cache it was selected from.
            cache.update(keys, values, index)
        self._cache = cache

    def truncate(self, n: int) -> None:
        remove = len(self._tokens) - n
        if remove <= 0:
            return
        if n == 0:
            self._cache = self._new_cache()
        else:
            self._cache.crop(-remove)
        del self._tokens[n:]

    @on_model_thread
    def select(self, n: int, positions: Sequence[int]) -> None:
        if contiguous(n, positions):
            self.truncate(n + len(positions))
            return
        keep = [*range(n), *positions]
        index = torch.tensor(keep, dtype=torch.long, device=self._backend.device)
        self._set_cache([(layer.keys.index_select(2, index), layer.values.index_select(2, index))
                         for layer in self._cache.layers])
        self._tokens = [self._tokens[i] for i in keep]


class HFBackend(Backend):
    name = "hf"
    tree_attention = True
    thread: ModelThread  # always one (model_thread)

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto",
                 threads: int = 0) -> None:
        """``threads``: torch's CPU threads for this model (0: as already set in this
        process, at first torch's choice); see :func:`model_thread`."""
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # no bars on load
        self.device = resolve_device(device)
        torch_dtype, self.dtype_reason = choose_dtype(dtype, self.device, model)
        local = Path(model).expanduser()
        if local.exists() and not (local / "config.json").is_file():
            raise InputError(f"model folder {model!r} has no config.json: point at a folder "
                             f"saved with save_pretrained, or at a hub id")
        source = str(local) if local.exists() else model
        looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1
        if not local.exists() and looks_like_path:
            raise InputError(f"model {model!r} not found: no such folder")
        self.thread = model_thread(threads)
        try:
            # Any: transformers' annotations of to() and get_output_embeddings()
            # do not type-check under mypy --strict.
            self.model: Any
            self.model, hf_tokenizer = self.thread.call(_load, source, torch_dtype, self.device,
                                                        threads)
        except (OSError, ValueError) as exc:
            raise InputError(f"could not load model {model!r}: not a local folder, and the hub "
                             f"id could not be loaded ({str(exc).splitlines()[0]})") from None
        config = self.model.config
        self.logits_width = int(self.model.get_output_embeddings().weight.shape[0])
        self.vocab_size = min(len(hf_tokenizer), self.logits_width)  # ids that are tokens
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.tokenizer = HFTokenizer(hf_tokenizer, eos_token_ids(
            source, hf_tokenizer, self.model.generation_config))
        text = config.get_text_config(decoder=True)
        # The KV cache's shape: layers, key/value heads, head size.
        self.kv_shape = (int(text.num_hidden_layers),
                         int(getattr(text, "num_key_value_heads", None)
                             or text.num_attention_heads),
                         int(getattr(text, "head_dim", None)
                             or text.hidden_size // text.num_attention_heads))
        # Whether every layer attends to the whole context (no sliding windows): the paged
        # path's one mask then serves every layer.
        layer_types = getattr(text, "layer_types", None)
        self.full_attention = (all(t == "full_attention" for t in layer_types)
                               if layer_types else not getattr(text, "sliding_window", None)
                               or getattr(text, "use_sliding_window", True) is False)
        layers, heads, head_dim = self.kv_shape
        self.kv_bytes_per_token = (2 * layers * heads * head_dim
                                   * torch.tensor([], dtype=torch_dtype).element_size())
        self.description = f"{model} ({type(self.model).__name__}, {torch_dtype}, {self.device})"
        self.cache_keyword = cache_keyword(self.model)

    def new_sequence(self) -> HFSequence:
        return HFSequence(self)

    def _own(self, sequence: CachedSequence) -> HFSequence:
        if not isinstance(sequence, HFSequence) or sequence._backend is not self:
            raise TypeError("extend_batch takes sequences made by this backend")
        return sequence

    def extend_batch(self, items: Sequence[Extend]) -> list[np.ndarray]:
        """``extend`` for each item, one by one, on transformers' own cache. The built-in
        runner batches a target in one forward on its packed, paged path instead
        (:mod:`spececd.backends.paged`)."""
        return [self._own(item.sequence).extend(*item[1:]) for item in items]

    def forward(self, cache: Any, **inputs: Any) -> tuple[torch.Tensor, Any]:
        """The logits of one forward pass over ``inputs`` that starts from the KV cache
        ``cache``, and the cache after it."""
        out = self.model(**inputs, **{self.cache_keyword: cache}, use_cache=True)
        return out.logits, out[self.cache_keyword]

    def additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A custom attention mask from ``allowed`` ``[batch, queries, keys]``: 0 where a
        query sees a key, the dtype's minimum elsewhere, ``[batch, 1, queries, keys]``."""
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.model.dtype).min)[:, None]

    def valid(self, logits: torch.Tensor) -> np.ndarray:
        """Logits of the token ids the tokenizer has: the rows a model pads its output
        embeddings with (Qwen2.5-0.5B to 151,936, -7B to 152,064, for 151,665 tokens) are
        never a token, so they are dropped here, before anything samples or verifies."""
        return logits[..., :self.vocab_size].float().cpu().numpy()
