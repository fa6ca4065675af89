"""The built-in runner's packed, paged path: a transformers target whose sessions' keys and
values live in pages of one pool, and whose batched pass is one forward over every row's
new tokens packed end to end, as an engine runs it (vLLM; transformers' own continuous
batching).

- **Pages.** The pool is one tensor, ``[2, layers, pages, PAGE, kv_heads, head_dim]``
  (keys, then values). A sequence holds a list of pages, taken as it grows and given back
  as it shrinks or is dropped. Page 0 is never given: padding reads it. With a cap
  (``--max-kv-bytes``) the pool is allocated whole at start and never grows (the runner
  sizes it: :func:`~spececd.cloud.builtin.pool_pages`): a pass that needs more pages than
  are free fails with :class:`PoolFull`; without one it starts small and doubles (one
  copy) when full, up to :data:`MEMORY_SHARE` of the memory free when it was made.
- **Packing.** A pass feeds the model one row of every item's tokens end to end
  (``[1, tokens]``): the MLPs and projections compute each token once, with no padding.
  Each token's position is its own (a tree token's is its depth's).
- **Attention.** Registered with transformers as an attention implementation
  (:func:`paged_attention`), used for the pass only: each layer writes its new keys and
  values into their pages (one ``index_copy_``), reads every row's pages (one
  ``index_select`` of whole pages; transformers' own SDPA path over a paged cache reads
  this way too, by index), and attends row by row in one batched SDPA call, each row's
  queries over its own pages only, with the mask the protocol needs (its cached tokens,
  and its tree or causal ancestors among the new ones). Only attention is padded (rows to
  the widest row, pages to the longest row's); transformers' paged SDPA instead attends
  every query to every row's keys under one block mask, a cost in rows squared. Nothing is
  copied back: the pass wrote in place.
- **Rollback** moves a length and gives back the pages past it; a tree's accepted path is
  copied to the front (its positions only).

What transformers' continuous-batching cache (``PagedAttentionCache``) does not give, and
why this module has its own pool: token trees (its masks are causal), rollback (its
allocator frees whole requests), and attention that does not grow with the square of the
batch on a CPU. The design is its: pages of one tensor, read and written by index.

Only attention is padded: its matmuls cost rows x widest row x the longest row's pages,
against the MLPs' tokens x hidden x intermediate. Small beside the MLPs while rows are
alike; a wide row (a prompt chunk) beside long contexts pads every row's attention to its
width (measured: docs/deploy/many-clients.md). The budget counts a pass as the sum of its
rows' positions and of their contexts (:class:`~spececd.core.budget.PassCost`), the fixed
shapes too.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from spececd.backends.base import (
    Backend,
    CachedSequence,
    Extend,
    ModelThread,
    is_chain,
    on_model_thread,
    resolve_keep,
    tree_layout,
)
from spececd.backends.hf import HFBackend
from spececd.errors import InputError

log = logging.getLogger(__name__)

PAGE = 16  # tokens a page holds
# Fixed shapes (CUDA graphs): the widths a pass's rows are padded to (a cloud-only step is
# one position) and the batch sizes its rows are padded to; larger passes run eagerly.
WIDTHS = (1, 8, 16, 32, 64)
BATCHES = (1, 2, 4, 8)
INITIAL_PAGES = 64  # an uncapped pool's first size (it doubles when full)
MEMORY_SHARE = 0.5  # of the memory free at start, what an uncapped pool may grow to
IMPLEMENTATION = "spececd_paged"  # the name paged_attention is registered under


class PoolFull(InputError):
    """A pass needs more pages than the pool has free and may hold (its cap, or the
    limit an uncapped pool grows to)."""


class PagePool:
    """The keys and values of every sequence of a :class:`PagedBackend`, in pages of one
    tensor ``data`` ``[2, layers, pages, PAGE, kv_heads, head_dim]``. ``capped``: the pool
    never grows; else it doubles when a take would fail, up to ``limit`` pages (0: no
    limit). Pages given back go through a queue that taking drains: a dropped sequence
    gives its pages back from whatever thread drops it, and from the garbage collector's
    finalizers too, which may run while a take holds the pool's lock."""

    def __init__(self, kv_shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device, pages: int, capped: bool, limit: int = 0) -> None:
        self.kv_shape, self.capped, self.limit = kv_shape, capped, limit
        self.data = self._tensor(max(pages, 2), dtype, device)
        self._free = list(range(self.pages - 1, 0, -1))  # page 0 is padding's
        self._lock = threading.Lock()
        self._given: queue.SimpleQueue[list[int]] = queue.SimpleQueue()

    def _tensor(self, pages: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        layers, heads, dim = self.kv_shape
        # A normal tensor even when made in a pass (under inference mode), so that it may be
        # written outside one too.
        with torch.inference_mode(False):
            return torch.zeros((2, layers, pages, PAGE, heads, dim), dtype=dtype,
                               device=device)

    @property
    def pages(self) -> int:
        """Pages in the pool, padding's included."""
        return int(self.data.shape[2])

    def _drain(self) -> None:
        """Put the pages given back since the last take on the free list (lock held)."""
        while not self._given.empty():
            self._free.extend(reversed(self._given.get_nowait()))

    @property
    def free(self) -> int:
        with self._lock:
            self._drain()
            return len(self._free)

    @property
    def used(self) -> int:
        return self.pages - 1 - self.free

    def check(self, n: int) -> None:
        """Raise :class:`PoolFull` where ``n`` pages cannot be taken."""
        with self._lock:
            self._drain()
            self._check(n)

    def _check(self, n: int) -> None:
        short = n - len(self._free)
        if short <= 0:
            return
        if self.capped:
            raise PoolFull(f"the KV cache is full: {n} more pages of {PAGE} tokens are needed "
                           f"and {len(self._free)} of {self.pages - 1} are free (sessions busy in "
                           f"passes hold the rest): raise --max-kv-bytes, or lower "
                           f"--max-batch or --max-batched-tokens")
        if self.limit and self.pages - 1 + short > self.limit:
            raise PoolFull(f"the KV cache has grown to {self.pages - 1} pages of {PAGE} tokens, "
                           f"half of the memory free when the server started, and {n} more "
                           f"are needed: set --max-kv-bytes (idle sessions' caches are then "
                           f"freed to stay within it), or lower --max-batch")

    def take(self, n: int) -> list[int]:
        """``n`` free pages, in the order they are to be used."""
        with self._lock:
            self._drain()
            self._check(n)
            if n > len(self._free):
                self._grow(self.pages - 1 + n - len(self._free))
            taken = self._free[-n:][::-1] if n else []
            del self._free[len(self._free) - n:]
        # Zeroed: a row's last page is read past its length (masked), and a masked NaN
        # left there by an earlier owner would still poison attention (0 x NaN).
        self.data[:, :, taken] = 0
        return taken

    def give(self, pages: Sequence[int]) -> None:
        self._given.put(list(pages))  # no lock: a finalizer may call this mid-take

    def _grow(self, needed: int) -> None:
        """At least double, to hold ``needed`` pages besides padding's (one copy)."""
        old = self.pages
        size = max(2 * old, needed + 1)
        if self.limit:
            size = min(size, self.limit + 1)
        data = self._tensor(size, self.data.dtype, self.data.device)
        data[:, :, :old] = self.data
        self.data = data
        self._free[:0] = range(size - 1, old - 1, -1)  # the new pages after the old free
        log.info("the KV page pool grew to %d pages of %d tokens", size, PAGE)


def free_memory(device: torch.device) -> int:
    """Bytes of memory free on ``device`` now (a GPU's own; the host's available memory
    for the CPU and others), 0 where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pages_for(tokens: int) -> int:
    """The pages ``tokens`` positions take."""
    return -(-tokens // PAGE)


def slots(pages: Sequence[int], positions: np.ndarray) -> np.ndarray:
    """The pool slots (``page * PAGE + offset``) of a sequence's ``positions``."""
    table: np.ndarray = np.asarray(pages, dtype=np.int64)
    result: np.ndarray = table[positions // PAGE] * PAGE + positions % PAGE
    return result


def attends(length: int, n: int, parents: Sequence[int] | None
            ) -> tuple[np.ndarray, np.ndarray]:
    """What each of ``n`` new tokens after ``length`` cached ones sees of its row's
    positions (``[n, length + n]``: the cached ones and its ancestors, a chain's being
    those before it) and the position each is given (``[n]``: a tree token's depth's).
    Nothing past ``length + n``: what a rollback left there is stale."""
    visible = np.ones((n, length + n), dtype=bool)
    if is_chain(parents):
        visible[:, length:] = np.tril(np.ones((n, n), dtype=bool))
        return visible, np.arange(length, length + n)
    assert parents is not None
    tree, depth = tree_layout(parents)
    visible[:, length:] = tree
    return visible, length + depth - 1


class PagedSequence:
    """A sequence of a :class:`PagedBackend`: its tokens, and the pages they are in."""

    def __init__(self, backend: PagedBackend) -> None:
        self._backend = backend
        self._tokens: list[int] = []
        self.pages: list[int] = []
        # Pages go back to the pool when the sequence is dropped (the list, not self).
        weakref.finalize(self, backend.pool.give, self.pages)

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def thread(self) -> ModelThread:
        return self._backend.thread

    def extend(self, ids: Sequence[int], keep: int | None = None,
               parents: Sequence[int] | None = None) -> np.ndarray:
        return self._backend.extend_batch([Extend(self, ids, resolve_keep(len(ids), keep),
                                                  parents)])[0]

    def reserve(self, length: int) -> None:
        """Hold pages for ``length`` tokens."""
        needed = pages_for(length) - len(self.pages)
        if needed > 0:
            self.pages.extend(self._backend.pool.take(needed))

    def truncate(self, n: int) -> None:
        del self._tokens[n:]
        keep = pages_for(len(self._tokens))
        if len(self.pages) > keep:  # what lies past the length is never read again
            self._backend.pool.give(self.pages[keep:])
            del self.pages[keep:]

    @on_model_thread
    @torch.inference_mode()
    def select(self, n: int, positions: Sequence[int]) -> None:
        keep = [*range(n), *positions]
        if keep != list(range(len(keep))):
            moved = np.asarray(positions, dtype=np.int64)
            source = torch.from_numpy(slots(self.pages, moved))
            target = torch.from_numpy(slots(self.pages, np.arange(n, n + len(moved))))
            flat = self._backend.flat()
            device = flat.device
            flat.index_copy_(2, target.to(device), flat.index_select(2, source.to(device)))
        self._tokens = [self._tokens[i] for i in keep]
        self.truncate(len(keep))


@dataclass
class PackedPass:
    """One pass's layout, shared by every layer: where the new tokens are written
    (``writes``, ``[tokens]`` pool slots), the pages each row reads (``reads``, ``[rows *
    pages]``, padded with page 0), the packed token of each (row, query) cell and the cell
    of each packed token (``queries``, ``[rows * widest]``; ``cells``, ``[tokens]``; None
    when every row is as wide), and the additive mask ``[rows, 1, widest, pages *
    PAGE]``."""

    pool: PagePool
    scratch: torch.Tensor  # flat, room for one layer's keys and values as read
    writes: torch.Tensor
    reads: torch.Tensor
    queries: torch.Tensor | None
    cells: torch.Tensor | None
    mask: torch.Tensor
    rows: int
    widest: int

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """Attention of layer ``layer`` over the pass: ``query`` ``[1, heads, tokens,
        head_dim]``, ``key`` and ``value`` ``[1, kv_heads, tokens, head_dim]`` (the new
        tokens'); returns ``[1, tokens, heads, head_dim]``."""
        keys, values = self.pages(layer, key, value)
        heads, dim = query.shape[1], query.shape[3]
        packed = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
        if self.queries is not None:
            packed = packed.index_select(0, self.queries)
        grid = packed.reshape(self.rows, self.widest, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            grid, keys, values, attn_mask=self.mask, scale=scaling,
            enable_gqa=heads != key.shape[1])  # [rows, heads, widest, head_dim]
        cells = out.transpose(1, 2).reshape(self.rows * self.widest, heads, dim)
        if self.cells is not None:
            cells = cells.index_select(0, self.cells)
        return cells[None]

    def pages(self, layer: int, key: torch.Tensor, value: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer``'s new ``key`` and ``value`` into their pages and read every
        row's: keys and values ``[rows, kv_heads, positions, head_dim]``."""
        data = self.pool.data
        width = data.shape[3] * (self.reads.shape[0] // self.rows)  # positions a row reads
        shape = (self.reads.shape[0], *data.shape[3:])  # [rows * pages, PAGE, ...]
        size = math.prod(shape)
        attended = []
        for kind, new in ((0, key), (1, value)):
            pages = data[kind, layer]  # [pages, PAGE, kv_heads, head_dim]
            flat = pages.view(-1, *pages.shape[2:])
            flat.index_copy_(0, self.writes, new[0].transpose(0, 1))
            # Into the backend's scratch: a fresh tensor each layer came as fresh pages from
            # the kernel, and faulting them in cost ten times the copy.
            read = self.scratch[kind * size:(kind + 1) * size].view(shape)
            torch.index_select(pages, 0, self.reads, out=read)
            attended.append(read.view(self.rows, width, *pages.shape[2:]).transpose(1, 2))
        return attended[0], attended[1]


_CURRENT = threading.local()  # the pass the model thread is running, if any


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0,
                    scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for a packed pass (:meth:`PackedPass.attend`).
    What it does not implement it refuses rather than ignores (a model whose layers cap
    their scores or add sinks would get other logits)."""
    for name in ("softcap", "s_aux", "sinks", "sliding_window"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the paged pass does not implement attention's "
                                      f"{name}; run this model with --static off and no "
                                      f"batching, or on vLLM")
    packed: PackedPass = _CURRENT.packed
    return packed.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(IMPLEMENTATION, paged_attention)


class Shape(NamedTuple):
    """A pass's rows, widest row, the pages each row reads and whether it is one of the
    fixed shapes (each row padded to ``widest``, every cell's logits kept)."""

    rows: int
    widest: int
    pages: int
    fixed: bool


class PagedBackend(Backend):
    """A transformers target (an :class:`~spececd.backends.hf.HFBackend`, loaded, whose
    layers all attend to the whole context) on the packed, paged path; see the module
    docstring. ``max_context``: the longest context a sequence takes (the server's limit;
    the model's own if shorter). ``pages``: the pool's size, allocated at once (0: no cap,
    the pool grows). ``fixed``: passes of a few fixed shapes (default: on CUDA), replayed
    from CUDA graphs where ``graphs`` (on CUDA only)."""

    name = "hf-paged"
    tree_attention = True
    kv_block = PAGE
    thread: ModelThread

    def __init__(self, hf: HFBackend, max_context: int, pages: int = 0,
                 fixed: bool | None = None, graphs: bool = True) -> None:
        if not hf.full_attention:
            raise InputError("the paged path runs models whose every layer attends to the "
                             "whole context; this one has sliding windows")
        self.hf, self.model, self.thread = hf, hf.model, hf.thread
        self.device, self.tokenizer, self.vocab_size = hf.device, hf.tokenizer, hf.vocab_size
        self.max_context = min(hf.max_context, max_context)
        self.kv_bytes_per_token = hf.kv_bytes_per_token
        limit = int(MEMORY_SHARE * free_memory(self.device)) // (PAGE * hf.kv_bytes_per_token)
        self.pool = PagePool(hf.kv_shape, self.model.dtype, self.device,
                             (pages or min(INITIAL_PAGES, limit or INITIAL_PAGES)) + 1,
                             capped=bool(pages), limit=limit)
        cuda = self.device.type == "cuda"
        # Fixed shapes: on CUDA, for graphs; a test may ask for them elsewhere, to run their
        # logic on a CPU. A pass of fixed shapes computes rows x its widest row.
        self.fixed = cuda if fixed is None else fixed
        self.graphs = Graphs(self.device) if graphs and cuda and self.fixed else None
        self.whole = pages_for(self.max_context)  # pages a row reads on fixed shapes
        self._scratch = torch.empty(0, dtype=self.model.dtype, device=self.device)
        size = (f"a pool of {pages} pages" if pages else
                f"a pool that grows to {limit} pages" if limit else "a pool that grows")
        shapes = ", CUDA graphs" if self.graphs else ", fixed shapes" if self.fixed else ""
        self.description = f"{hf.description}, paged KV ({PAGE}-token pages, {size}{shapes})"
        self._configs = {id(c): c for c in (self.model.config,
                                            self.model.config.get_text_config(decoder=True))}

    def new_sequence(self) -> PagedSequence:
        return PagedSequence(self)

    def kv_pages(self) -> tuple[int, int]:
        return self.pool.used, self.pool.free

    def flat(self) -> torch.Tensor:
        """The pool as slots: ``[2, layers, pages * PAGE, kv_heads, head_dim]``."""
        data = self.pool.data
        return data.view(*data.shape[:2], -1, *data.shape[4:])

    def _own(self, sequence: CachedSequence) -> PagedSequence:
        if not isinstance(sequence, PagedSequence) or sequence._backend is not self:
            raise TypeError("extend_batch takes sequences made by this backend")
        return sequence

    @on_model_thread
    @torch.inference_mode()
    def extend_batch(self, items: Sequence[Extend]) -> list[np.ndarray]:
        """One forward over every item's new tokens, packed (see the module docstring);
        equal to separate ``extend`` calls up to float rounding."""
        if not items:
            return []
        if any(len(item.ids) == 0 for item in items):  # nothing to compute for them
            work = [item for item in items if len(item.ids)]
            done = iter(self.extend_batch(work) if work else [])
            empty = np.zeros((0, self.vocab_size), dtype=np.float32)
            return [next(done) if len(item.ids) else empty for item in items]
        own = [self._own(item.sequence) for item in items]
        lengths = [len(sequence.tokens) for sequence in own]
        counts = [len(item.ids) for item in items]
        if len({id(sequence) for sequence in own}) < len(own):
            raise ValueError("extend_batch takes each sequence once")
        for item, length, n in zip(items, lengths, counts, strict=True):
            if length + n > self.max_context:
                raise ValueError(f"{length + n} tokens exceed the context of "
                                 f"{self.max_context}")
            if not 0 <= item.keep <= n:
                raise ValueError(f"keep must be 0 to {n}, got {item.keep}")
            if not is_chain(item.parents):
                tree_layout(item.parents or [])  # a malformed tree raises before any page
        needed = sum(max(0, pages_for(length + n) - len(sequence.pages))
                     for sequence, length, n in zip(own, lengths, counts, strict=True))
        self.pool.check(needed)  # before any sequence holds more
        for sequence, length, n in zip(own, lengths, counts, strict=True):
            sequence.reserve(length + n)
        shape = self._shape(lengths, counts)
        inputs, firsts = self._layout(items, own, lengths, shape)
        if self.graphs is not None and shape.fixed:
            # Room for the largest fixed shape at once: a larger batch would move the
            # scratch and drop every graph captured over it.
            self._scratch_for(2 * BATCHES[-1] * shape.pages
                              * math.prod(self.pool.data.shape[3:]))
            key = (shape.rows, shape.widest, self.pool.pages, self.pool.data.data_ptr(),
                   self._scratch.data_ptr())
            logits = self.graphs.run(key, inputs, self._run)
        else:
            logits = self._run(inputs)  # [kept, vocab]
        results = []
        for sequence, item, first in zip(own, items, firsts, strict=True):
            sequence._tokens.extend(int(t) for t in item.ids)
            results.append(self.hf.valid(logits[first:first + item.keep]))
        return results

    def _scratch_for(self, elements: int) -> torch.Tensor:
        """A flat tensor of at least ``elements``, kept from pass to pass (it grows by a
        quarter past the largest pass seen)."""
        if self._scratch.numel() < elements:
            with torch.inference_mode(False):
                self._scratch = torch.empty(elements + elements // 4, dtype=self.model.dtype,
                                            device=self.device)
        return self._scratch[:elements]

    def _shape(self, lengths: list[int], counts: list[int]) -> Shape:
        """A pass's shape: on fixed shapes, where its rows and widest row fit
        :data:`BATCHES` and :data:`WIDTHS`, the narrowest that hold them and the whole
        context; else (a pass larger than any fixed shape runs eagerly) as it is, packed."""
        rows, widest = len(counts), max(counts)
        if self.fixed and rows <= BATCHES[-1] and widest <= WIDTHS[-1]:
            return Shape(next(size for size in BATCHES if size >= rows),
                         next(width for width in WIDTHS if width >= widest), self.whole, True)
        return Shape(rows, widest, max(pages_for(length + n)
                                       for length, n in zip(lengths, counts, strict=True)),
                     False)

    def _run(self, inputs: dict[str, torch.Tensor],
             attention: type[PackedPass] | None = None) -> torch.Tensor:
        """The logits ``[kept, vocab]`` of the model's forward over one pass's ``inputs``
        (:meth:`_layout`), its attention :meth:`PackedPass.attend` (``attention``'s: a
        benchmark's, scripts/pass-cost.py)."""
        rows, _, widest, _ = inputs["mask"].shape
        data = self.pool.data
        size = 2 * inputs["reads"].shape[0] * math.prod(data.shape[3:])
        packed = (attention or PackedPass)(
            self.pool, self._scratch_for(size), inputs["writes"], inputs["reads"],
            inputs.get("queries"), inputs.get("cells"), inputs["mask"], rows, widest)
        _CURRENT.packed = packed
        saved = {key: config._attn_implementation for key, config in self._configs.items()}
        try:
            for config in self._configs.values():
                config._attn_implementation = IMPLEMENTATION
            out = self.model(input_ids=inputs["ids"], position_ids=inputs["positions"],
                             attention_mask=packed.mask, logits_to_keep=inputs["kept"],
                             use_cache=False)
        finally:
            for key, config in self._configs.items():
                config._attn_implementation = saved[key]
            _CURRENT.packed = None
        logits: torch.Tensor = out.logits[0]
        return logits

    def _layout(self, items: Sequence[Extend], own: list[PagedSequence], lengths: list[int],
                shape: Shape) -> tuple[dict[str, torch.Tensor], list[int]]:
        """A pass's inputs (:meth:`_run`), and where each item's kept logits begin. Each
        row takes its own tokens in the packed row, or, in a fixed shape, ``widest`` of them
        (the rest, and padding rows', padding: token 0, written to page 0, seeing its
        row's first position only, its logits dropped)."""
        rows, widest, pages, fixed = shape
        reads = np.zeros((rows, pages), dtype=np.int64)
        allowed = np.zeros((rows, widest, pages * PAGE), dtype=bool)
        allowed[:, :, 0] = True  # a padding query sees a key (else its softmax is NaN)
        spans = [widest if fixed else len(item.ids) for item in items]
        total = rows * widest if fixed else sum(spans)
        ids = np.zeros(total, dtype=np.int64)
        writes, positions = np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64)
        queries, cells, kept, firsts = [], [], [], []
        start = done = 0  # the row's first token; the logits kept before it
        for i, (item, sequence, length, span) in enumerate(zip(items, own, lengths, spans,
                                                               strict=True)):
            n = len(item.ids)
            held = pages_for(length + n)  # the pages its positions are in
            reads[i, :held] = sequence.pages[:held]
            ids[start:start + n] = item.ids
            writes[start:start + n] = slots(sequence.pages, np.arange(length, length + n))
            visible, positions[start:start + n] = attends(length, n, item.parents)
            allowed[i, :n, :visible.shape[1]] = visible
            queries.append(np.concatenate([np.arange(start, start + n),
                                           np.zeros(widest - n, dtype=np.int64)]))
            cells.append(np.arange(i * widest, i * widest + n))
            firsts.append(start + n - item.keep if fixed else done)
            done += item.keep
            kept.append(np.arange(start + n - item.keep, start + n))
            start += span
        device, dtype = self.device, self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype)
        mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(dtype).min)

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        inputs = {"ids": tensor(ids)[None], "positions": tensor(positions)[None],
                  "writes": tensor(writes), "reads": tensor(reads.ravel()),
                  "mask": mask[:, None].to(device),
                  "kept": tensor(np.arange(total) if fixed else np.concatenate(kept))}
        if not fixed and min(len(item.ids) for item in items) < widest:
            inputs["queries"] = tensor(np.concatenate(queries))
            inputs["cells"] = tensor(np.concatenate(cells))
        return inputs, firsts


Run = Callable[[dict[str, torch.Tensor]], torch.Tensor]


class Graphs:
    """CUDA graphs of a pass's forward, one per shape key, captured on first use: the
    inputs are copied into the graph's own tensors, the graph replayed, its logits copied
    out. The pool (its size and address) and the scratch a graph reads and writes are part
    of its key (one that grew is a new tensor: its graphs are captured anew, the old ones
    dropped)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # captured and replayed on it (the thread's current is cuda:0)
        self._graphs: dict[tuple[int, ...], tuple[Any, dict[str, torch.Tensor],
                                                  torch.Tensor]] = {}
        self._failed: set[tuple[int, ...]] = set()
        self._pool: Any = None  # one memory pool for every graph: they never run at once

    def run(self, key: tuple[int, ...], inputs: dict[str, torch.Tensor],
            run: Run) -> torch.Tensor:
        """``run(inputs)``, replayed from the graph of ``key``."""
        with torch.cuda.device(self.device):
            return self._run(key, inputs, run)

    def _run(self, key: tuple[int, ...], inputs: dict[str, torch.Tensor],
             run: Run) -> torch.Tensor:
        if key in self._failed:
            return run(inputs)
        entry = self._graphs.get(key)
        if entry is None:
            self._graphs = {k: v for k, v in self._graphs.items() if k[-3:] == key[-3:]}
            try:
                entry = self._graphs[key] = self._capture(inputs, run)
            except Exception as exc:  # that shape stays eager
                log.warning("could not capture a CUDA graph for %s (%s): it runs eagerly",
                            key[:-3], exc)
                self._failed.add(key)
                return run(inputs)
        graph, static_inputs, logits = entry
        for name, tensor in inputs.items():
            static_inputs[name].copy_(tensor)
        graph.replay()
        return logits.clone()

    def _capture(self, inputs: dict[str, torch.Tensor],
                 run: Run) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up passes, as capture requires; they write
            for _ in range(2):  # the pages the real pass writes next
                run(static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = run(static_inputs)
        return graph, static_inputs, logits
