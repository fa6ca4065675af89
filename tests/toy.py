"""A torch-free toy backend: numpy only, deterministic, fast, for protocol, engine and edge
tests.

:class:`ToyBackend` implements :class:`spececd.backends.base.Backend` exactly, trees
included. Its "model" predicts token ``i + 1`` from the two tokens at ``i - 1`` and ``i``
and the position ``i``: the logits row is one of a fixed table of seeded random rows,
picked by a hash of ``(tokens[i - 1], tokens[i], i)``. So a cache that holds a wrong
token (a rollback or a tree gather gone wrong) gives other logits, as in a real model,
while a fresh pass over the same tokens (:meth:`ToyModel.forward`, the slow reference)
gives the same ones exactly.

Two models make a draft/target pair with a chosen ``agreement``: the draft returns the
target's own row at that share of contexts (picked by another hash) and a row of its own
elsewhere, so its greedy token equals the target's at about that share of positions.

The tokenizer is byte-level: ids 0-255 are the bytes, 256 is the end-of-sequence token;
it has no start token, no chat template and cannot be exported as files.

This module imports no torch: ``tests/test_toy.py`` checks that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from spececd.backends.base import Backend, CachedSequence, is_chain, resolve_keep, tree_layout

EOS = 256
VOCAB = 257
NO_TOKEN = VOCAB  # what precedes the first token in the model's hash
ROWS = 1024  # distinct logits rows in a model's table
_MASK = (1 << 64) - 1


class ByteTokenizer:
    """A byte-level tokenizer: enough for a fingerprint, encoding prompts and decoding."""

    eos_token_ids: tuple[int, ...] = (EOS,)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(t) for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def vocab_tokens(self) -> list[str]:
        return [f"<0x{b:02X}>" for b in range(256)] + ["<|endoftext|>"]

    def files(self) -> dict[str, bytes]:
        return {}

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int] | None:
        return None


def _mix(*values: int) -> int:
    """A 64-bit hash of small integers (splitmix64 steps): deterministic across runs,
    unlike ``hash``."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 29
    return h


class ToyModel:
    """The logits function: ``row(previous, token, position)`` is the ``[vocab]`` float32
    logits after ``token`` at ``position``, given the token before it."""

    def __init__(self, seed: int = 0, scale: float = 4.0, agree_with: ToyModel | None = None,
                 agreement: float = 1.0) -> None:
        self.seed = seed
        self.table = (np.random.default_rng(seed).standard_normal((ROWS, VOCAB))
                      * scale).astype(np.float32)  # [rows, vocab]
        self.agree_with, self.agreement = agree_with, agreement

    def row(self, previous: int, token: int, position: int) -> np.ndarray:  # [vocab]
        other = self.agree_with
        if other is not None and \
                _mix(previous, token, position, 0xA9) % 10_000 < self.agreement * 10_000:
            return other.row(previous, token, position)
        row: np.ndarray = self.table[_mix(self.seed, previous, token, position) % ROWS]
        return row

    def forward(self, tokens: Sequence[int]) -> np.ndarray:  # [len(tokens), vocab]
        """A fresh pass over ``tokens``: the conformance suite's reference."""
        rows = [self.row(tokens[i - 1] if i else NO_TOKEN, tokens[i], i)
                for i in range(len(tokens))]
        return np.stack(rows) if rows else np.zeros((0, VOCAB), dtype=np.float32)


class ToySequence:
    """A cache over one token sequence. The toy's whole "KV cache" is its token list: the
    logits of a new position are computed from the cached tokens before it."""

    def __init__(self, backend: ToyBackend) -> None:
        self._backend = backend
        self._tokens: list[int] = []

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def extend(self, ids: Sequence[int], keep: int | None = None,
               parents: Sequence[int] | None = None) -> np.ndarray:
        n, keep = len(ids), resolve_keep(len(ids), keep)
        backend = self._backend
        if len(self._tokens) + n > backend.max_context:
            raise ValueError(f"{len(self._tokens) + n} tokens exceed the context of "
                             f"{backend.max_context}")
        if any(not 0 <= int(t) < backend.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {backend.vocab_size}), got {list(ids)}")
        ids = [int(t) for t in ids]
        if is_chain(parents):
            parents = list(range(-1, n - 1))
        assert parents is not None
        _, depth = tree_layout(parents)  # checks the tree
        start = len(self._tokens)
        last = self._tokens[-1] if self._tokens else NO_TOKEN
        rows = [backend.model.row(ids[p] if p >= 0 else last, ids[j], start + int(depth[j]) - 1)
                for j, p in enumerate(parents)]
        backend.calls.append(n)
        if backend.pass_s or backend.position_s:
            time.sleep(backend.pass_s + backend.position_s * max(0, n - 1))
        self._tokens.extend(ids)
        logits = np.stack(rows) if rows else np.zeros((0, VOCAB), dtype=np.float32)
        return logits[n - keep:]

    def truncate(self, n: int) -> None:
        del self._tokens[n:]

    def select(self, n: int, positions: Sequence[int]) -> None:
        self._tokens[:] = [*self._tokens[:n], *(self._tokens[p] for p in positions)]


class ToyBackend(Backend):
    """A :class:`~spececd.backends.base.Backend` over a :class:`ToyModel`. ``calls``: the
    number of tokens each ``extend`` fed, in order (to check what a cache re-feeds).
    ``pass_s``: seconds each ``extend`` sleeps, for a target as slow as a real one next to
    the edge (stream drafting's hints then reach the server before its next step), and
    ``position_s`` more for each position it feeds past the first (a target whose verify
    passes cost more than its steps, as llama.cpp's do on a CPU)."""

    name = "toy"
    tree_attention = True

    def __init__(self, model: ToyModel, max_context: int = 4096, pass_s: float = 0.0,
                 position_s: float = 0.0) -> None:
        self.model, self.pass_s, self.position_s = model, pass_s, position_s
        self.description = f"toy model (seed {model.seed}, numpy)"
        self.vocab_size = VOCAB
        self.max_context = max_context
        self.kv_bytes_per_token = 64
        self.tokenizer = ByteTokenizer()
        self.calls: list[int] = []

    def new_sequence(self) -> CachedSequence:
        return ToySequence(self)


def toy_pair(agreement: float = 0.7, seed: int = 0) -> tuple[ToyBackend, ToyBackend]:
    """A (draft, target) pair whose draft agrees with the target at ``agreement`` of
    contexts."""
    target = ToyModel(seed)
    return ToyBackend(ToyModel(seed + 1, agree_with=target, agreement=agreement)), \
        ToyBackend(target)


def greedy(backend: ToyBackend, prompt: Sequence[int], n: int) -> list[int]:
    """The reference: ``n`` tokens of ``backend``'s own greedy decoding after ``prompt``,
    each from a fresh forward pass (no cache, no stop token)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(backend.model.forward(tokens)[-1])))
    return tokens[len(prompt):]
