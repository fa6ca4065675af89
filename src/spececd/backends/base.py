"""The interface every model runtime implements (docs/how-it-works.md, "Layers": layer 3).

A :class:`Backend` is a loaded model plus its tokenizer. It hands out
:class:`CachedSequence` objects, each a KV cache over one token sequence, so that one loaded
target can serve many sessions. A sequence knows three operations:

- ``extend(ids, keep)``: run the model over ``ids`` appended to the cached tokens and return
  the logits of the last ``keep`` new positions, ``[keep, vocab]`` float32 (``keep=None``:
  all of them; ``keep=0``: none, e.g. a prefill);
- ``truncate(n)``: forget every token after the first ``n`` (KV rollback);
- ``tokens``: the cached token ids.

A backend with ``tree_attention`` also extends by a **tree** of tokens:
``extend(ids, keep, parents)``, where ``parents[i]`` is the index in ``ids`` of the token
``ids[i]`` follows, or ``-1`` for the last cached token (a chain: ``-1, 0, 1, ...``). Each
new token attends to the cached tokens and its own ancestors only, at the position of its
depth, so its logits are those of the path that leads to it. The cache then holds the tree
in ``ids`` order until ``select(n, positions)`` keeps the first ``n`` cached tokens and
those at ``positions`` (ascending, each at least ``n``): the accepted path, gathered. A
backend without it refuses a tree with ``ValueError``; ``select`` of a contiguous run is a
``truncate`` everywhere.

Logits at position ``i`` are the model's prediction for token ``i + 1``. The contract
checked by the conformance suite: after any sequence of extend/truncate calls, ``extend``
returns the logits a fresh forward pass over the same tokens would give.

A backend declares what callers may ask of it, so that nobody probes with ``getattr``:
``name``, ``description`` (for people), ``vocab_size``, ``max_context``,
``kv_bytes_per_token`` (what one token of context costs in KV cache, for memory limits),
``kv_block`` (the tokens its cache is allocated in), ``tree_attention``, ``extend_batch``
(several sequences' extends, in one forward pass where the runtime can), ``kv_pages``
(pages of a paged cache in use and free) and ``thread`` (the one thread its work runs on,
or None).
Backends subclass :class:`Backend` explicitly and so inherit the looping
``extend_batch``; mypy then reports a declared attribute a backend never sets, and a class
that only matches structurally must define every member, ``extend_batch`` included.

Heavy imports (torch, llama_cpp, ...) live in each backend's own module.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, NamedTuple, ParamSpec, Protocol, TypeVar

import numpy as np

from spececd.core.tokens import common_prefix
from spececd.core.verify import check_tree
from spececd.errors import InputError
from spececd.protocol.messages import Fingerprint


class Tokenizer(Protocol):
    """What SpecECD needs of a tokenizer."""

    eos_token_ids: tuple[int, ...]

    # ``bos``: begin with the tokenizer's own start tokens (a prompt), or not (a piece of
    # text inside a sequence).
    def encode(self, text: str, bos: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def vocab_tokens(self) -> list[str]: ...  # token string of each id, in id order
    # The files transformers rebuilds this tokenizer from; empty when it cannot be exported.
    def files(self) -> dict[str, bytes]: ...
    # A conversation as prompt ids through the model's chat template, with the generation
    # prompt; None when it has no template. ``tools``: OpenAI's function tools, rendered by
    # the template (an InputError when the template takes none: see takes_tools).
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int] | None: ...


def takes_tools(template: str) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable: one that does not would
    drop the tools silently."""
    return re.search(r"\btools\b", template) is not None


def no_tools_error() -> InputError:
    return InputError("this model's chat template does not take tools (it never reads "
                      "`tools`), so the model would not see them: leave tools out, or serve "
                      "a model whose template renders them")


class CachedSequence(Protocol):
    @property
    def tokens(self) -> list[int]: ...
    def extend(self, ids: Sequence[int], keep: int | None = None,
               parents: Sequence[int] | None = None) -> np.ndarray: ...
    def truncate(self, n: int) -> None: ...
    def select(self, n: int, positions: Sequence[int]) -> None: ...


class Extend(NamedTuple):
    """One sequence's part of :meth:`Backend.extend_batch`."""

    sequence: CachedSequence
    ids: Sequence[int]
    keep: int
    parents: Sequence[int] | None = None  # a tree over ids (tree_attention backends)


P = ParamSpec("P")
R = TypeVar("R")


class ModelThread:
    """One thread that runs every call of a runtime in this process.

    PyTorch's CPU kernels run on GNU OpenMP, which keeps a team of worker threads for each
    thread that starts parallel work. With more of them than cores (a draft on the caller's
    thread and a verification on the server's, each with its team), libgomp stops letting
    its idle workers spin, so every one of a forward pass's hundreds of parallel regions
    waits for its workers to wake: measured here, a 5-position pass of the default target
    at two threads took 21-23 ms instead of 15. Calls from any thread are run on this one,
    and a call made on it runs at once, so work on it never waits for itself.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        self._ident = self._executor.submit(threading.get_ident).result()

    @property
    def executor(self) -> Executor:
        """The thread, as an executor. A forked child has none of its parent's threads: its
        first use there starts the thread again."""
        if self._pid != os.getpid():
            self._start()
        return self._executor

    def here(self) -> bool:
        return threading.get_ident() == self._ident and self._pid == os.getpid()

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` on this thread; the caller waits for its result."""
        if self.here():
            return fn(*args, **kwargs)
        return self.executor.submit(fn, *args, **kwargs).result()


def on_model_thread(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` of a backend or a sequence whose ``thread`` is a :class:`ModelThread`,
    run on that thread."""
    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        thread = args[0].thread  # type: ignore[attr-defined]
        assert isinstance(thread, ModelThread), "on_model_thread: an owner with a ModelThread"
        return thread.call(method, *args, **kwargs)
    return call


class Backend(Protocol):
    name: str  # short runtime name: "hf", "llama.cpp"
    description: str  # model, runtime and settings, for logs and status pages
    # Token ids the model's tokenizer has, and the width of the logits it returns: a model
    # that pads its output embeddings past its tokenizer returns the tokenizer's ids only.
    vocab_size: int
    max_context: int  # positions the model supports
    kv_bytes_per_token: int  # KV cache one token of context costs in one sequence
    # (llama.cpp reserves a sequence's whole context when it makes it: see its module)
    kv_block: int = 1  # a sequence's cache is held in blocks of this many tokens
    tokenizer: Tokenizer
    tree_attention: bool = False  # extend takes trees (see the module docstring)
    # The thread this backend's model work runs on (its calls move there themselves), so
    # that a runner can run its passes there without a second hop; None: the caller's.
    thread: ModelThread | None = None

    def new_sequence(self) -> CachedSequence: ...

    def extend_batch(self, items: Sequence[Extend]) -> list[np.ndarray]:
        """``sequence.extend(ids, keep, parents)`` for each item, in order, each sequence
        made by this backend. This default runs them one by one; a backend that can run
        them as one forward pass overrides it with the same results."""
        return [item.sequence.extend(item.ids, item.keep, item.parents) for item in items]

    def kv_pages(self) -> tuple[int, int]:
        """Pages of KV cache in use and free; (0, 0) where the cache is not paged."""
        return 0, 0


class ChainSequence:
    """The part of a :class:`CachedSequence` that every runtime without tree attention
    shares (llama.cpp, ONNX Runtime GenAI, OpenVINO). Subclasses run the model over new
    tokens in ``_run`` and roll their cache back in ``_rollback``; this class checks the
    arguments and the context limit, keeps ``tokens``, cuts the logits to the tokenizer's
    ids, and makes ``select`` of a contiguous run a truncate (trees are refused)."""

    runtime = ""  # the runtime's name, for messages

    def __init__(self, vocab_size: int, max_context: int) -> None:
        self._tokens: list[int] = []
        self._vocab_size = vocab_size
        self._max_context = max_context

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def _run(self, ids: list[int], keep: int) -> np.ndarray:
        """Evaluate ``ids`` after the cached tokens; the logits of (at least) the last
        ``keep`` new positions, ``[rows, width >= vocab]``."""
        raise NotImplementedError

    def _rollback(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (``n`` below the cached count)."""
        raise NotImplementedError

    def extend(self, ids: Sequence[int], keep: int | None = None,
               parents: Sequence[int] | None = None) -> np.ndarray:
        if not is_chain(parents):
            raise ValueError(f"the {self.runtime} backend verifies chains only "
                             "(no tree attention)")
        n, keep = len(ids), resolve_keep(len(ids), keep)
        if n == 0:
            return np.zeros((0, self._vocab_size), dtype=np.float32)
        if len(self._tokens) + n > self._max_context:
            raise ValueError(f"{len(self._tokens) + n} tokens exceed the context of "
                             f"{self._max_context}")
        logits = self._run([int(t) for t in ids], keep)
        if logits.ndim != 2 or logits.shape[0] < keep or logits.shape[1] < self._vocab_size:
            raise RuntimeError(f"the {self.runtime} model returned logits of shape "
                               f"{logits.shape} for {n} new tokens: it must return every "
                               "new position's")
        self._tokens.extend(int(t) for t in ids)
        return np.array(logits[logits.shape[0] - keep:, :self._vocab_size], dtype=np.float32)

    def truncate(self, n: int) -> None:
        if n < len(self._tokens):
            self._rollback(n)
            del self._tokens[n:]

    def select(self, n: int, positions: Sequence[int]) -> None:
        if not contiguous(n, positions):
            raise ValueError(f"the {self.runtime} backend keeps contiguous runs only "
                             "(no trees)")
        self.truncate(n + len(positions))


def tokenizer_fingerprint(tokenizer: Tokenizer, vocab_size: int) -> Fingerprint:
    """Two models are compatible when their tokenizers map the same strings to the same ids:
    the fingerprint is the number of token ids and a hash of each id's string. How far a
    model pads its logits past its tokenizer is not compared (its backend drops the
    padding), nor is the file format."""
    tokens = tokenizer.vocab_tokens()[:vocab_size]
    digest = hashlib.sha256("\n".join(tokens).encode("utf-8", "surrogatepass"))
    return Fingerprint(vocab_size=vocab_size, tokenizer_hash=digest.hexdigest())


def resolve_keep(n: int, keep: int | None) -> int:
    """How many positions' logits an ``extend`` of ``n`` tokens returns."""
    keep = n if keep is None else keep
    if not 0 <= keep <= n:
        raise ValueError(f"keep must be in [0, {n}], got {keep}")
    return keep


def is_chain(parents: Sequence[int] | None) -> bool:
    return parents is None or all(parent == i - 1 for i, parent in enumerate(parents))


def tree_layout(parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """For a tree over ``n`` new tokens: which of them each one sees (its ancestors and
    itself, ``[n, n]`` bool) and its depth (1 for a child of the last cached token, ``[n]``)."""
    n = len(parents)
    check_tree(parents, n)
    visible = np.eye(n, dtype=bool)
    depth = np.ones(n, dtype=np.int64)
    for i, parent in enumerate(parents):
        if parent >= 0:
            visible[i] |= visible[parent]
            depth[i] = depth[parent] + 1
    return visible, depth


def contiguous(n: int, positions: Sequence[int]) -> bool:
    """Whether ``positions`` are ``n, n + 1, ...``: a ``select`` that is a ``truncate``."""
    return all(position == n + i for i, position in enumerate(positions))


def sync(sequence: CachedSequence, context: Sequence[int]) -> list[int]:
    """Cut ``sequence`` to the longest cached prefix of ``context`` shorter than it; return
    the tokens of ``context`` still to be fed (never empty when ``context`` is not)."""
    cached = sequence.tokens
    n = common_prefix(cached, context[:len(context) - 1])
    if n < len(cached):
        sequence.truncate(n)
    return list(context[n:])
