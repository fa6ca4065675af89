"""llama.cpp through llama-cpp-python: GGUF models, on the CPU or on a GPU the build has
(Metal, CUDA), at any quantization llama.cpp supports.

Each :class:`LlamaCppSequence` owns one llama.cpp context (one KV cache); on the CPU the
weights are memory-mapped once by the operating system and shared by every context. A
sequence evaluates through llama.cpp's batch API (``llama_decode``), asking for the logits
of the positions ``extend`` returns only (not llama-cpp-python's ``logits_all``, which
computes the output layer at every position, prompts included, and keeps a copy of every
position's logits: ``n_ctx`` rows of the vocabulary). Rollback removes the KV cache's
cells past the point kept. Contexts are separate, so ``extend_batch`` is the interface's
default: one evaluation per sequence.

llama.cpp reserves a context's whole KV cache when it makes the context (``n_ctx``
positions, keys and values in f16, its default cache type), so a sequence occupies
``n_ctx * kv_bytes_per_token`` bytes from the start, however few tokens it holds. Making a
context costs milliseconds (16-19 ms for the default target in f16: llama-cpp-python loads
the model's file again for each, and the cache is allocated and cleared), so the contexts
of ended sequences are kept, up to ``IDLE_CONTEXTS``, and the next sequences take them
emptied: a server's new session starts at once. Kept contexts hold their caches (a session
evicted under ``--max-kv-bytes`` frees its context's only past that many), and with GPU
layers each holds its own copy of the offloaded weights on the GPU, so there one is kept.
``kv_bytes_per_token`` comes from the GGUF's metadata (layers, KV heads, key and value
widths); a GGUF without attention metadata (a recurrent model) is refused. For models with
sliding-window layers it is an upper bound.

The backend's ``n_threads`` (``--threads``) sets both of llama.cpp's thread counts:
``n_threads`` for one-token steps and ``n_threads_batch`` for evaluations of several tokens
(prefills, verification passes, drafter catch-ups), which llama-cpp-python would otherwise
run on every core of the machine.

The tokenizer is the GGUF's own: its vocabulary strings, in id order, give the same
fingerprint as the transformers tokenizer the GGUF was converted from, so a GGUF drafter
and a transformers verifier (or the reverse) are compatible exactly when their tokenizers
are the same.

This module is the only one that imports llama_cpp.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spececd.backends.base import Backend, ChainSequence, no_tools_error, takes_tools
from spececd.errors import InputError

log = logging.getLogger(__name__)

KV_ELEMENT_BYTES = 2  # f16, llama.cpp's default KV cache type; contexts keep the default
UNUSED = 1 << 1  # LLAMA_TOKEN_ATTR_UNUSED: a converter's padding, not a token
N_BATCH = 512  # tokens per llama.cpp evaluation
IDLE_CONTEXTS = 4  # contexts of ended sequences kept for new ones


def _quiet_llama_logs() -> None:
    import llama_cpp

    def _ignore(level: int, text: bytes, user_data: Any) -> None:
        pass

    drop = llama_cpp.llama_log_callback(_ignore)
    llama_cpp.llama_log_set(drop, None)
    _quiet_llama_logs.callback = drop  # type: ignore[attr-defined]  # keep it alive


# Every llama.cpp model (its weights and context) this process made, for _close_at_exit.
_models: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_at_exit() -> None:
    """Free every llama.cpp context and model this process made while Python is whole,
    then give llama.cpp back its own logger. Freed later, as the interpreter clears its
    modules, llama-cpp-python's module globals may be gone already (its ``__del__`` then
    prints a TypeError at exit and frees nothing), and llama.cpp logs as it frees a context,
    through the callback :func:`_quiet_llama_logs` set, which that clearing frees: a call
    into freed memory. Registered with atexit, which runs before that clearing."""
    if not _models:
        return
    import llama_cpp

    for llm in list(_models):
        llm.close()
    llama_cpp.llama_log_set(llama_cpp.llama_log_callback(), None)  # NULL: llama.cpp's own


atexit.register(_close_at_exit)


class LlamaCppTokenizer:
    def __init__(self, llm: Any) -> None:
        self._llm = llm
        metadata = llm.metadata
        self._add_bos = metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
        eos = llm.token_eos()
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos >= 0 else ()
        self._chat: Any = None  # the chat template's formatter, made on first use

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=bos and self._add_bos,
                                       special=True))

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self._piece(int(t)) for t in ids).decode("utf-8", errors="replace")

    def _piece(self, token: int) -> bytes:
        """A token's bytes. llama-cpp-python's ``detokenize`` reads each piece into 32
        bytes and drops longer ones (runs of indentation in a code tokenizer), so this asks
        llama.cpp again with the size it says it needs."""
        import llama_cpp

        size = 32
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._llm._model.vocab, token, buffer, size, 0,
                                               True)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def files(self) -> dict[str, bytes]:
        return {}  # a GGUF's tokenizer has no transformers files to rebuild it from

    def vocab_tokens(self) -> list[str]:
        model = self._llm._model
        return [model.token_get_text(i) for i in range(token_count(self._llm))]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int] | None:
        """The GGUF's ``tokenizer.chat_template`` rendered the way llama.cpp's Python
        bindings render it (Jinja2, sandboxed, with the generation prompt, ``tools``
        included), then tokenized with special tokens and no extra BOS (the template
        writes its own); None when the GGUF has no template."""
        template = self._llm.metadata.get("tokenizer.chat_template")
        if not template:
            return None
        if tools and not takes_tools(template):
            raise no_tools_error()
        if self._chat is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            def text(token: int) -> str:
                return str(self._llm._model.token_get_text(token)) if token >= 0 else ""

            self._chat = Jinja2ChatFormatter(template, eos_token=text(self._llm.token_eos()),
                                             bos_token=text(self._llm.token_bos()))
        prompt = self._chat(messages=messages, tools=tools or None).prompt
        return list(self._llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True))


def devices() -> list[dict[str, str]]:
    """The llama.cpp build's device: the CPU, and whether it offloads layers to a GPU."""
    import llama_cpp

    gpu = bool(llama_cpp.llama_supports_gpu_offload())
    return [{"device": "cpu", "backend": "llama.cpp",
             "detail": f"llama.cpp {llama_cpp.__version__}"
             + (", GPU offload available" if gpu else ", CPU build")}]


def token_count(llm: Any) -> int:
    """The ids that are tokens: llama.cpp's vocabulary less the padding a converter appends
    to reach the model's embedding width (``[PAD151665]``..., marked unused), as in Qwen2.5
    GGUFs; the same count as the transformers tokenizer's length."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = int(llm.n_vocab())
    while n > 0 and llama_cpp.llama_vocab_get_attr(vocab, n - 1) & UNUSED:
        n -= 1
    return n



class LlamaCppSequence(ChainSequence):
    """One llama.cpp context, evaluated through llama.cpp's own batch API: logits are
    asked for the positions ``extend`` returns only, and read where llama.cpp wrote them."""

    runtime = "llama.cpp"

    def __init__(self, backend: LlamaCppBackend, llm: Any) -> None:
        import llama_cpp

        super().__init__(backend.vocab_size, backend.max_context)
        self._llm, self._lib, self._n_batch = llm, llama_cpp, N_BATCH
        self._width = int(llm.n_vocab())  # the rows llama.cpp writes: its whole vocabulary
        self._batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)
        # Kept for the next sequence (the finalizer holds the deque, not the backend)
        weakref.finalize(self, backend._idle.append, llm).atexit = False
        self._rollback(0)  # a context starts empty (a kept one holds its last cache)

    def _run(self, ids: list[int], keep: int) -> np.ndarray:
        lib, ctx, batch = self._lib, self._llm.ctx, self._batch
        start, first = len(self._tokens), len(ids) - keep  # the first position returned
        rows: list[np.ndarray] = []
        for offset in range(0, len(ids), self._n_batch):
            chunk = ids[offset:offset + self._n_batch]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i], batch.pos[i] = token, start + offset + i
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
                batch.logits[i] = offset + i >= first
            status = lib.llama_decode(ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama.cpp could not evaluate {len(chunk)} tokens after "
                                   f"{start + offset} (llama_decode returned {status}: "
                                   "1 means no room left in the context)")
            outputs = offset + len(chunk) - max(first, offset)
            if outputs > 0:  # the flagged rows, in order; valid until the next evaluation
                view = np.ctypeslib.as_array(lib.llama_get_logits(ctx),
                                             shape=(outputs, self._width))
                rows.append(view if offset + len(chunk) == len(ids) else view.copy())
        if len(rows) == 1:
            return rows[0]
        return np.concatenate(rows) if rows else np.zeros((0, self._width), np.float32)

    def _rollback(self, n: int) -> None:
        self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self._llm.ctx), -1, n, -1)


class LlamaCppBackend(Backend):
    name = "llama.cpp"

    def __init__(self, model: str, n_threads: int = 0, n_gpu_layers: int = 0,
                 n_ctx: int = 0) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise InputError("GGUF models need the llama.cpp backend: "
                             "pip install 'spececd[llama]'") from None
        path = Path(model).expanduser()
        if not path.is_file():
            raise InputError(f"GGUF file {model!r} not found")
        _quiet_llama_logs()
        threads = n_threads or min(4, os.cpu_count() or 1)
        self._kwargs: dict[str, Any] = dict(
            model_path=str(path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, logits_all=False,
            n_threads=threads, n_threads_batch=threads, verbose=False, n_batch=N_BATCH)
        try:
            first: Any = Llama(**self._kwargs)
        except (ValueError, RuntimeError) as exc:
            raise InputError(f"llama.cpp could not load {model!r}: {exc}") from None
        _models.add(first)
        # Contexts no sequence holds. A sequence's finalizer appends its own, on whatever
        # thread drops it: a bounded deque appends atomically, dropping the oldest.
        self._idle: deque[Any] = deque([first], maxlen=IDLE_CONTEXTS if not n_gpu_layers
                                       else 1)
        self.vocab_size = token_count(first)
        self.max_context = int(first.n_ctx())
        try:
            self.kv_bytes_per_token = kv_bytes_per_token(first.metadata)
        except (KeyError, ValueError) as exc:
            raise InputError(f"{model!r} does not describe an attention KV cache that "
                             f"llama.cpp would size per token ({exc})") from None
        self.tokenizer = LlamaCppTokenizer(first)
        self.description = (f"{path.name} (llama.cpp, {threads} threads, "
                            f"{n_gpu_layers} GPU layers)")

    def new_sequence(self) -> LlamaCppSequence:
        from llama_cpp import Llama

        try:
            llm = self._idle.pop()  # emptied by the sequence when it starts
        except IndexError:
            llm = Llama(**self._kwargs)
            _models.add(llm)
        return LlamaCppSequence(self, llm)


def kv_bytes_per_token(metadata: Mapping[str, str]) -> int:
    """Bytes of KV cache one token costs, from a GGUF's metadata (llama.cpp's strings):
    keys and values for every layer's KV heads. Key and value widths default to
    ``embedding_length / head_count``, as in llama.cpp."""
    arch = metadata["general.architecture"]
    layers = int(metadata[f"{arch}.block_count"])
    heads = metadata[f"{arch}.attention.head_count"]
    kv_heads = _per_layer(metadata.get(f"{arch}.attention.head_count_kv", heads), layers)

    def width(kind: str) -> int:
        given = metadata.get(f"{arch}.attention.{kind}_length")
        if given is not None:
            return int(given)
        return int(metadata[f"{arch}.embedding_length"]) // _per_layer(heads, layers)[0]

    return sum(kv_heads) * (width("key") + width("value")) * KV_ELEMENT_BYTES


def _per_layer(value: str, layers: int) -> list[int]:
    """A GGUF count given once for every layer (``"8"``) or per layer (``"[8, 8, 0]"``)."""
    parsed = json.loads(value)
    return [int(n) for n in parsed] if isinstance(parsed, list) else [int(parsed)] * layers
