"""The built-in runner's static path: a transformers target whose KV cache lives in slots
allocated once, and whose forward passes have a few fixed shapes, so that on a GPU they
can be replayed from captured CUDA graphs.

On a GPU a small target's step is kernel launches and Python rather than memory traffic
(7 ms for the 30M default target on an H200, 8 layers at about 0.9 ms each). A graph
replays the launches of a whole forward at once, and a graph needs every tensor it reads
and writes at a fixed address with a fixed shape. Hence:

- **Slots.** Each sequence has a slot: per layer, keys and values ``[1, heads,
  context + widest, head_dim]``, allocated on its first use and reused by later sequences
  once it is freed (when its sequence is dropped). Rolling back is moving a length:
  ``truncate`` forgets tokens without touching the tensors, and the next pass writes over
  them. A tree's accepted path is gathered to the front of the slot (``select``).
- **Fixed widths.** A pass over ``n`` new tokens runs at the narrowest of :data:`WIDTHS`
  that holds them (one position for a cloud-only step; a verification padded to 8, 16, ...);
  the padding tokens see only themselves, are written past the sequence's length (so never
  read) and their logits are dropped. Prefills longer than the widest run at their own
  width, eagerly; a batch that would not fit a slot so runs item by item.
- **Fixed keys.** Attention reads ``attended`` positions of a slot: on fixed shapes (CUDA)
  the whole slot (one shape per width, for graphs), elsewhere the context rounded up to
  :data:`BLOCK` (a CPU pass then costs what the context costs, as with a growing cache).
- **Batches.** Several sequences' passes run as one batch of the same width: their slots'
  cached keys and values are gathered into one batch (a copy) and the new positions written
  back. On fixed shapes every pass, a lone sequence's too, is padded to the narrowest of
  :data:`BATCHES` with rows that see only themselves and gathered into the first rows of
  the backend's own tensors (so a graph per batch size and width serves every session; the
  copy is of the cached positions only, cheap beside a forward); a larger batch runs
  eagerly. Elsewhere a lone sequence reads and writes its slot in place.

Each pass gives the model a cache object of its own (:class:`_SlotCache`) whose ``update``
writes the new keys and values at each row's positions and returns the attended keys and
values, and a 4D attention mask saying what each new token sees (the cached tokens and its
tree ancestors): transformers then runs its own attention over them, so any architecture
transformers runs with a 4D mask works here. Graph capture (:class:`_Graphs`) runs on CUDA
only, once per batch size and width (at most 4 x 5 graphs); a capture that fails leaves
that shape eager, with a warning.

The conformance suite holds it to the backend contract (``extend`` gives what a fresh
forward over the same tokens gives) on the CPU, eager; CI has no GPU, so the capture itself
is exercised only by ``scripts/gpu-bench.sh`` on a lent GPU.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spececd.backends.base import (
    Backend,
    CachedSequence,
    Extend,
    ModelThread,
    on_model_thread,
    resolve_keep,
    tree_layout,
)
from spececd.backends.hf import HFBackend

log = logging.getLogger(__name__)

# The widths a pass over new tokens is padded to (a cloud-only step is one position).
WIDTHS = (1, 8, 16, 32, 64)
# The batch sizes a pass is padded to on fixed shapes (graphs); a larger batch runs eagerly.
BATCHES = (1, 2, 4, 8)
BLOCK = 64  # off CUDA, attention reads the context rounded up to a multiple of this


def width_for(n: int) -> int:
    """The width a pass over ``n`` new tokens runs at: the narrowest of :data:`WIDTHS`
    that holds them, else ``n`` itself (a long prefill)."""
    return next((width for width in WIDTHS if width >= n), n)


def attended_for(needed: int, room: int, whole: bool) -> int:
    """How many positions of a slot of ``room`` attention reads when the pass needs
    ``needed``: all of them (``whole``: one shape, for graphs), else ``needed`` rounded up
    to :data:`BLOCK`."""
    return room if whole else min(room, -(-needed // BLOCK) * BLOCK)


@dataclass(frozen=True)
class Layout:
    """One row of a pass: where its tokens are written in its slot (``writes``, ``[width]``,
    the positions after the cached ones), the positions the model gives them (``positions``,
    ``[width]``: a tree token's is its depth's) and what each sees (``allowed``,
    ``[width, attended]``)."""

    writes: np.ndarray
    positions: np.ndarray
    allowed: np.ndarray


def layout(length: int, n: int, width: int, attended: int,
           parents: Sequence[int] | None) -> Layout:
    """The row for ``n`` new tokens (a tree over them with ``parents``) after ``length``
    cached ones, padded to ``width``, attending to ``attended`` positions. A padding token
    sees only itself."""
    writes = np.arange(length, length + width)
    positions = writes.copy()
    allowed = np.zeros((width, attended), dtype=bool)
    allowed[:n, :length] = True
    if parents is None:
        allowed[:n, length:length + n] = np.tril(np.ones((n, n), dtype=bool))
    else:
        visible, depth = tree_layout(parents)
        allowed[:n, length:length + n] = visible
        positions[:n] = length + depth - 1
    pad = np.arange(n, width)
    allowed[pad, length + pad] = True
    return Layout(writes, positions, allowed)


class _Slot:
    """Keys and values in one tensor, ``data`` ``[2, layers, rows, heads, positions,
    head_dim]`` (one row for a sequence's slot, a row per sequence for a pass's batch), so
    that a row is copied in one operation; ``keys`` and ``values`` are its layers' views,
    ``[rows, heads, positions, head_dim]``."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.keys, self.values = list(data[0]), list(data[1])

    def first(self, positions: int) -> _Slot:
        """A view of the first ``positions`` positions."""
        return _Slot(self.data[:, :, :, :, :positions])


class _SlotCache:
    """What the model's attention layers are given as their cache for one pass: ``update``
    writes a layer's new keys and values at each row's ``writes`` and returns the attended
    keys and values. Nothing else of transformers' cache API is asked for when the mask is
    a 4D one."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 writes: torch.Tensor) -> None:
        self.keys, self.values, self.writes = keys, values, writes  # writes: [batch, width]
        self.rows = torch.arange(writes.shape[0], device=writes.device)[:, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]  # [batch, heads, attended, dim]
        keys.transpose(1, 2)[self.rows, self.writes] = key.transpose(1, 2)
        values.transpose(1, 2)[self.rows, self.writes] = value.transpose(1, 2)
        return keys, values

    def get_seq_length(self, layer: int = 0) -> int:
        return 0  # positions and the mask are given; nothing derives them from this


class StaticSequence:
    """A sequence in a slot of a :class:`StaticBackend`; see the module docstring."""

    def __init__(self, backend: StaticBackend) -> None:
        self._backend = backend
        self._tokens: list[int] = []
        self._slot: _Slot | None = None

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def thread(self) -> ModelThread:
        return self._backend.thread

    def slot(self) -> _Slot:
        """This sequence's slot, taken on first use; freed when the sequence is dropped."""
        if self._slot is None:
            self._slot = self._backend.take_slot()
            weakref.finalize(self, self._backend.free_slot, self._slot)
        return self._slot

    def extend(self, ids: Sequence[int], keep: int | None = None,
               parents: Sequence[int] | None = None) -> np.ndarray:
        return self._backend.extend_batch([Extend(self, ids, resolve_keep(len(ids), keep),
                                                  parents)])[0]

    def truncate(self, n: int) -> None:
        del self._tokens[n:]  # the slot's tensors are written over by the next pass

    @on_model_thread
    @torch.inference_mode()
    def select(self, n: int, positions: Sequence[int]) -> None:
        keep = [*range(n), *positions]
        if keep != list(range(len(keep))):
            slot = self.slot()
            index = torch.tensor(keep, dtype=torch.long, device=self._backend.device)
            slot.data[:, :, :, :, :len(keep)] = slot.data.index_select(4, index)
        self._tokens = [self._tokens[i] for i in keep]


class StaticBackend(Backend):
    """A transformers target (an :class:`~spececd.backends.hf.HFBackend`, loaded) on the
    static path; see the module docstring. ``max_context``: the longest context a slot
    holds (the server's limit; the model's own if shorter). ``graphs``: capture CUDA graphs
    (on CUDA only)."""

    name = "hf-static"
    tree_attention = True
    padded = True
    thread: ModelThread  # the transformers model's own

    def __init__(self, hf: HFBackend, max_context: int, graphs: bool = True,
                 fixed: bool | None = None) -> None:
        self.hf, self.model, self.thread = hf, hf.model, hf.thread
        self.device, self.tokenizer, self.vocab_size = hf.device, hf.tokenizer, hf.vocab_size
        self.max_context = min(hf.max_context, max_context)
        self.kv_bytes_per_token = hf.kv_bytes_per_token
        self.room = self.max_context + WIDTHS[-1]  # a padded pass may write past the context
        cuda = self.device.type == "cuda"
        # Fixed shapes (whole slots, batches padded to BATCHES): on CUDA, for graphs; a test
        # may ask for them elsewhere, to run their logic on a CPU.
        self.fixed = cuda if fixed is None else fixed
        self.graphs = _Graphs() if graphs and cuda and self.fixed else None
        self.description = (f"{hf.description}, static KV slots of {self.max_context} "
                            f"tokens{', CUDA graphs' if self.graphs else ''}")
        self._free: list[_Slot] = []
        self._scratch: _Slot | None = None  # a padding row's slot (fixed shapes)
        self._staging: _Slot | None = None  # a pass's rows, gathered (fixed shapes)
        self.slots = 0  # allocated for sequences

    def new_sequence(self) -> StaticSequence:
        return StaticSequence(self)

    def take_slot(self) -> _Slot:
        """A slot for a new sequence: a freed one, else a new one."""
        if self._free:
            return self._free.pop()
        self.slots += 1
        return self._new_slot(1)

    def _new_slot(self, rows: int) -> _Slot:
        """Zeroed keys and values for ``rows`` sequences, ``room`` positions each."""
        layers, heads, dim = self.hf.kv_shape
        return _Slot(torch.zeros((2, layers, rows, heads, self.room, dim),
                                 dtype=self.model.dtype, device=self.device))

    def free_slot(self, slot: _Slot) -> None:
        """Give a dropped sequence's slot to the next one."""
        self._free.append(slot)

    @on_model_thread
    @torch.inference_mode()
    def extend_batch(self, items: Sequence[Extend]) -> list[np.ndarray]:
        """One pass over every item's new tokens (see the module docstring); equal to
        separate ``extend`` calls up to float rounding."""
        own = [self._own(item.sequence) for item in items]
        counts = [len(item.ids) for item in items]
        lengths = [len(sequence.tokens) for sequence in own]
        for length, n in zip(lengths, counts, strict=True):
            if length + n > self.max_context:
                raise ValueError(f"{length + n} tokens exceed the context of "
                                 f"{self.max_context}")
        width = width_for(max(counts))
        room = max(self.room, max(lengths) + width)
        attended = attended_for(max(lengths) + width, room, self.fixed)
        if attended > self.room:  # a long prefill beside a long context: each on its own
            return [self.extend_batch([item])[0] for item in items]
        rows = [layout(length, n, width, attended, None if item.parents is None
                       or list(item.parents) == list(range(-1, n - 1)) else item.parents)
                for item, length, n in zip(items, lengths, counts, strict=True)]
        ids = np.zeros((len(items), width), dtype=np.int64)
        for i, item in enumerate(items):
            ids[i, :counts[i]] = list(item.ids)
        slots = [sequence.slot() for sequence in own]
        logits = self._forward(slots, ids, rows, attended)
        results = []
        for i, (sequence, item, n) in enumerate(zip(own, items, counts, strict=True)):
            sequence._tokens.extend(int(t) for t in item.ids)
            results.append(self.hf.valid(logits[i, n - item.keep:n]))
        return results

    def _forward(self, slots: list[_Slot], ids: np.ndarray, rows: list[Layout],
                 attended: int) -> torch.Tensor:
        """Logits ``[batch, width, vocab]`` of one pass; each slot's new keys and values
        end in the slot."""
        device, dtype, width, real = self.device, self.model.dtype, ids.shape[1], len(slots)
        padded = next((size for size in BATCHES if size >= real), real) if self.fixed \
            else real
        if padded > real:  # padding rows: a scratch slot, tokens that see only themselves
            if self._scratch is None:
                self._scratch = self._new_slot(1)
            slots = [*slots, *[self._scratch] * (padded - real)]
            rows = [*rows, *[layout(0, 0, width, attended, None)] * (padded - real)]
            ids = np.concatenate([ids, np.zeros((padded - real, width), dtype=ids.dtype)])
        writes = torch.from_numpy(np.stack([row.writes for row in rows])).to(device)
        positions = torch.from_numpy(np.stack([row.positions for row in rows])).to(device)
        allowed = torch.from_numpy(np.stack([row.allowed for row in rows])).to(device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        inputs = {"input_ids": torch.from_numpy(ids).to(device), "position_ids": positions,
                  "attention_mask": mask, "writes": writes}
        staged = self.fixed and padded in BATCHES
        if staged:  # gathered into the first rows of the backend's own tensors
            if self._staging is None:
                self._staging = self._new_slot(BATCHES[-1])
            batch = _Slot(self._staging.data[:, :, :padded])
            # Each real row's cached positions only: what lies past them is never seen
            # (the mask), and a padding row sees only what it writes.
            for i, (slot, row) in enumerate(zip(slots[:real], rows, strict=False)):
                cached = int(row.writes[0])
                batch.data[:, :, i, :, :cached] = slot.data[:, :, 0, :, :cached]
        elif padded == 1:  # in place
            batch = slots[0].first(attended)
        else:  # gathered anew
            batch = _Slot(torch.cat([slot.first(attended).data for slot in slots], dim=2))
        if self.graphs is not None and staged and width in WIDTHS:
            logits = self.graphs.run((padded, width), inputs, batch, self._run)
        else:
            logits = self._run(inputs, batch)
        if staged or padded > 1:  # the new positions back into each real row's slot
            for i, (slot, row) in enumerate(zip(slots[:real], rows, strict=False)):
                start, end = int(row.writes[0]), int(row.writes[-1]) + 1
                slot.data[:, :, 0, :, start:end] = batch.data[:, :, i, :, start:end]
        return logits

    def _run(self, inputs: dict[str, torch.Tensor], batch: _Slot) -> torch.Tensor:
        cache = _SlotCache(batch.keys, batch.values, inputs["writes"])
        out = self.model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                         attention_mask=inputs["attention_mask"],
                         **{self.hf.cache_keyword: cache}, use_cache=True)
        logits: torch.Tensor = out.logits
        return logits

    def _own(self, sequence: CachedSequence) -> StaticSequence:
        if not isinstance(sequence, StaticSequence) or sequence._backend is not self:
            raise TypeError("extend_batch takes sequences made by this backend")
        return sequence


Run = Callable[[dict[str, torch.Tensor], _Slot], torch.Tensor]


class _Graphs:
    """CUDA graphs of the forward, one per shape key, captured on first use: the inputs are
    copied into the graph's own tensors, the graph replayed, its logits copied out. The
    keys and values it reads and writes are the same tensors at every replay of a key (a
    slot's own, or the batch size's gathered ones)."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[Any, ...], tuple[Any, dict[str, torch.Tensor],
                                                  torch.Tensor]] = {}
        self._failed: set[tuple[Any, ...]] = set()
        self._pool: Any = None  # one memory pool for every graph: they never run at once

    def run(self, key: tuple[Any, ...], inputs: dict[str, torch.Tensor], batch: _Slot,
            run: Run) -> torch.Tensor:
        """``run(inputs, batch)``, replayed from the graph of ``key``."""
        if key in self._failed:
            return run(inputs, batch)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._graphs[key] = self._capture(inputs, batch, run)
            except Exception as exc:  # that shape stays eager
                log.warning("could not capture a CUDA graph for %s (%s): it runs eagerly",
                            key, exc)
                self._failed.add(key)
                return run(inputs, batch)
        graph, static_inputs, logits = entry
        for name, tensor in inputs.items():
            static_inputs[name].copy_(tensor)
        graph.replay()
        return logits.clone()

    def _capture(self, inputs: dict[str, torch.Tensor], batch: _Slot,
                 run: Run) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up passes, as capture requires; they write
            for _ in range(2):  # the same keys and values the real pass writes next
                run(static_inputs, batch)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = run(static_inputs, batch)
        return graph, static_inputs, logits
