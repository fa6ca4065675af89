"""The static path's own logic, on the CPU (:mod:`spececd.backends.static`): widths,
attended lengths and rows, slot reuse, rollback by length, a long prefill beside a long
context, and a tree's accepted path gathered in its slot. That its logits equal a fresh
forward's for chains, trees and batches is the backend conformance suite's
(``tests/backends/test_conformance.py``, its ``-static`` subjects)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from spececd.backends.base import Extend
from tests.reference import LOGIT_TOLERANCE

torch = pytest.importorskip("torch")

from spececd.backends.hf import HFBackend  # noqa: E402
from spececd.backends.static import (  # noqa: E402
    BLOCK,
    WIDTHS,
    StaticBackend,
    attended_for,
    layout,
    width_for,
)


def test_a_pass_runs_at_the_narrowest_width_that_holds_it() -> None:
    assert [width_for(n) for n in (1, 2, 8, 9, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]
    assert width_for(WIDTHS[-1] + 1) == WIDTHS[-1] + 1  # a long prefill: its own width


def test_attention_reads_whole_slots_for_graphs_else_the_context_in_blocks() -> None:
    assert attended_for(10, 600, whole=True) == 600
    assert attended_for(10, 600, whole=False) == BLOCK
    assert attended_for(BLOCK + 1, 600, whole=False) == 2 * BLOCK
    assert attended_for(590, 600, whole=False) == 600  # never past the slot


def test_a_row_sees_the_cache_its_ancestors_and_padding_only_itself() -> None:
    row = layout(length=3, n=3, width=8, attended=16, parents=[-1, 0, -1])
    assert row.writes.tolist() == list(range(3, 11))
    assert row.positions[:3].tolist() == [3, 4, 3]  # each token at its depth
    assert row.allowed[:3, :3].all()  # the cached tokens
    assert row.allowed[1, 3:6].tolist() == [True, True, False]  # its parent and itself
    assert row.allowed[2, 3:6].tolist() == [False, False, True]  # a sibling of the first
    for pad in range(3, 8):  # padding: itself alone, never a real token's key
        assert row.allowed[pad].tolist() == [i == 3 + pad for i in range(16)]
    assert not row.allowed[:3, 6:].any()
    chain = layout(length=0, n=2, width=2, attended=4, parents=None)
    assert chain.allowed.tolist() == [[True, False, False, False], [True, True, False, False]]


@pytest.fixture()
def pair(tiny_models: dict[str, Path]) -> tuple[HFBackend, StaticBackend]:
    hf = HFBackend(str(tiny_models["llama"]), device="cpu", dtype="float32")
    return hf, StaticBackend(hf, max_context=160)


def fresh(hf: HFBackend, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).logits[0].float().numpy()  # type: ignore[no-any-return]


def test_a_dropped_sequence_frees_its_slot_for_the_next(
        pair: tuple[HFBackend, StaticBackend]) -> None:
    hf, static = pair
    rng = np.random.default_rng(0)
    first = static.new_sequence()
    first.extend([int(t) for t in rng.integers(0, static.vocab_size, 40)], keep=0)
    del first
    gc.collect()
    tokens = [int(t) for t in rng.integers(0, static.vocab_size, 12)]
    second = static.new_sequence()  # the same slot, its tensors still holding the first's
    logits = second.extend(tokens)
    assert static.slots == 1
    assert np.abs(logits - fresh(hf, tokens)).max() <= LOGIT_TOLERANCE


def test_rollback_moves_a_length_and_the_next_pass_writes_over(
        pair: tuple[HFBackend, StaticBackend]) -> None:
    hf, static = pair
    sequence = static.new_sequence()
    sequence.extend([5, 6, 7, 8, 9, 10], keep=0)
    sequence.truncate(3)
    logits = sequence.extend([11, 12])
    assert sequence.tokens == [5, 6, 7, 11, 12]
    assert np.abs(logits - fresh(hf, [5, 6, 7, 11, 12])[3:]).max() <= LOGIT_TOLERANCE


def test_a_long_prefill_beside_a_long_context_runs_item_by_item(
        pair: tuple[HFBackend, StaticBackend]) -> None:
    hf, static = pair
    rng = np.random.default_rng(1)
    long = [int(t) for t in rng.integers(0, static.vocab_size, 150)]
    short = static.new_sequence()
    short.extend(long[:140], keep=0)
    prompt = [int(t) for t in rng.integers(0, static.vocab_size, 100)]
    prefill = static.new_sequence()
    # 140 cached + a width of 100 would not fit a slot of 160 + 64: each runs alone.
    results = static.extend_batch([Extend(short, long[140:141], 1), Extend(prefill, prompt, 1)])
    assert np.abs(results[0] - fresh(hf, long[:141])[-1:]).max() <= LOGIT_TOLERANCE
    assert np.abs(results[1] - fresh(hf, prompt)[-1:]).max() <= LOGIT_TOLERANCE
    with pytest.raises(ValueError, match="exceed the context of 160"):
        short.extend(long[141:150] + long[:20])


def test_a_trees_accepted_path_is_gathered_in_its_slot(
        pair: tuple[HFBackend, StaticBackend]) -> None:
    hf, static = pair
    sequence = static.new_sequence()
    sequence.extend([3, 4, 5], keep=0)
    sequence.extend([20, 21, 22, 23], parents=[-1, -1, 1, 2])  # 20 | 21 -> 22 -> 23
    sequence.select(3, [4, 5])  # keep 21 and 22
    assert sequence.tokens == [3, 4, 5, 21, 22]
    logits = sequence.extend([30])
    assert np.abs(logits - fresh(hf, [3, 4, 5, 21, 22, 30])[-1:]).max() <= LOGIT_TOLERANCE


def test_fixed_shapes_pad_a_batch_and_read_whole_slots(
        pair: tuple[HFBackend, StaticBackend]) -> None:
    """The shapes graphs are captured for, run eagerly here: whole slots, a batch of three
    padded to four with a row that sees only itself, gathered into the backend's own rows
    (which still hold an earlier pass's keys past each row's length), a tree among them,
    then a lone sequence through the same rows; each row's logits are a fresh forward's."""
    hf, _ = pair
    fixed = StaticBackend(hf, max_context=160, fixed=True)
    assert fixed.fixed and fixed.graphs is None  # no CUDA here: the shapes, not the graphs
    rng = np.random.default_rng(2)
    streams = [[int(t) for t in rng.integers(0, fixed.vocab_size, 40)] for _ in range(3)]
    sequences = [fixed.new_sequence() for _ in streams]
    for sequence, stream, cached in zip(sequences, streams, (30, 5, 12), strict=True):
        sequence.extend(stream[:cached], keep=0)
    for round_ in range(2):
        parents = [-1, 0, 0] if round_ else None  # a tree in the second batch
        items = [Extend(sequences[0], streams[0][30 + 3 * round_:33 + 3 * round_], 3),
                 Extend(sequences[1], [streams[1][5 + round_]], 1),
                 Extend(sequences[2], streams[2][12 + 3 * round_:15 + 3 * round_], 3,
                        parents)]
        results = fixed.extend_batch(items)
        assert fixed._staging is not None  # gathered into the backend's own rows
        for item, sequence, logits in zip(items, sequences, results, strict=True):
            context = sequence.tokens[:len(sequence.tokens) - len(item.ids)]
            if item.parents is None:
                expected = fresh(hf, [*context, *item.ids])[-len(item.ids):]
            else:  # a token and its two children: each child's path is the token and it
                expected = np.stack([fresh(hf, [*context, item.ids[0]])[-1],
                                     fresh(hf, [*context, item.ids[0], item.ids[1]])[-1],
                                     fresh(hf, [*context, item.ids[0], item.ids[2]])[-1]])
            assert np.abs(logits - expected).max() <= LOGIT_TOLERANCE
    lone = sequences[1].extend([7, 8])  # row 0 of the same tensors, its own cache gathered
    assert np.abs(lone - fresh(hf, sequences[1].tokens)[-2:]).max() <= LOGIT_TOLERANCE
    assert fixed.slots == 3  # the padding row's slot is the backend's own, not a sequence's
