"""The packed, paged path's own logic, on the CPU (:mod:`spececd.backends.paged`): rows of
every width packed in one pass, the fixed shapes of CUDA graphs (run eagerly here), pages
taken and given back, a capped pool that refuses what it cannot hold and an uncapped one
that grows, and three planted bugs (a page given
to two sequences, a row that reads past its length after a rollback, a page left dirty by
its last owner) that the checks here catch. That its logits equal a fresh forward's over
random extends, truncations and trees is the conformance suite's
(``tests/backends/test_conformance.py``, its ``-paged`` subjects)."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from spececd.backends.base import Extend
from spececd.cloud.runner import RunnerConfig
from tests.reference import LOGIT_TOLERANCE
from tests.support.conformance import difference

torch = pytest.importorskip("torch")

from spececd.backends import paged  # noqa: E402
from spececd.backends.hf import HFBackend  # noqa: E402
from spececd.backends.paged import (  # noqa: E402
    BATCHES,
    PAGE,
    WIDTHS,
    PagedBackend,
    PagePool,
    PoolFull,
)
from spececd.cloud.builtin import pool_pages, runner_path  # noqa: E402


@pytest.fixture(scope="module")
def hf(tiny_models: dict[str, Path]) -> HFBackend:
    return HFBackend(str(tiny_models["llama"]), device="cpu", dtype="float32")


def fresh(hf: HFBackend, tokens: Sequence[int]) -> np.ndarray:
    return hf.new_sequence().extend(list(tokens))


def tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def interleaved_worst(backend: PagedBackend, hf: HFBackend, seed: int = 0,
                      steps: int = 20) -> float:
    """Three sequences extended together in passes of unequal rows (a prompt, a token, a
    draft), each sometimes rolled back: the largest |difference| of their logits from a
    fresh forward's."""
    rng = np.random.default_rng(seed)
    sequences = [backend.new_sequence() for _ in range(3)]
    worst = 0.0
    for _ in range(steps):
        items = []
        for sequence in sequences:
            if sequence.tokens and rng.random() < 0.3:
                sequence.truncate(int(rng.integers(0, len(sequence.tokens))))
            add = int(rng.choice([1, 3, 5, 21]))
            if len(sequence.tokens) + add <= backend.max_context:
                items.append(Extend(sequence, tokens(rng, add, backend.vocab_size), add))
        for item, logits in zip(items, backend.extend_batch(items), strict=True):
            expected = fresh(hf, item.sequence.tokens)[-len(item.ids):]
            worst = max(worst, difference(logits, expected))
    return worst


def test_rows_of_every_width_go_in_one_pass_and_give_what_separate_extends_give(
        hf: HFBackend) -> None:
    backend = PagedBackend(hf, max_context=200)
    rng = np.random.default_rng(1)
    contexts = [tokens(rng, n, hf.vocab_size) for n in (0, 17, 40, 5)]
    new = [tokens(rng, n, hf.vocab_size) for n in (30, 1, 4, 6)]
    parents = [None, None, None, [-1, 0, 0, 1, 2, 2]]  # a tree beside chains
    sequences = [backend.new_sequence() for _ in contexts]
    for sequence, context in zip(sequences, contexts, strict=True):
        if context:
            sequence.extend(context, 0)
    results = backend.extend_batch([Extend(s, ids, len(ids), p)
                                    for s, ids, p in zip(sequences, new, parents, strict=True)])
    for context, ids, tree, logits in zip(contexts, new, parents, results, strict=True):
        alone = hf.new_sequence()
        if context:
            alone.extend(context, 0)
        expected = alone.extend(ids, len(ids), tree)
        assert np.abs(logits - expected).max() < LOGIT_TOLERANCE
    assert interleaved_worst(backend, hf) < LOGIT_TOLERANCE


def test_fixed_shapes_pad_rows_and_widths_and_read_whole_contexts(hf: HFBackend) -> None:
    """The shapes graphs are captured for, run eagerly here: three rows padded to four
    (a padding row sees only page 0), each row padded to the narrowest width that holds
    the widest, every row reading the whole context's pages (past each row's length,
    what earlier passes left), a tree among them; then a lone row, a pass of more rows
    than any fixed size and a prefill wider than any fixed width (eager, their own
    shapes, packed). Each row's logits are a fresh forward's."""
    fixed = PagedBackend(hf, max_context=160, fixed=True)
    assert fixed.fixed and fixed.graphs is None  # no CUDA: shapes only
    assert fixed._shape([30, 5, 12], [3, 1, 3]) == (4, 8, 10, True)
    assert fixed._shape([0], [100]) == (1, 100, 7, False)  # a long prefill: packed, eager
    assert fixed._shape([0] * 9, [1] * 9) == (9, 1, 1, False)  # more rows than BATCHES
    assert BATCHES[-1] == 8 and WIDTHS[-1] == 64
    rng = np.random.default_rng(2)
    streams = [tokens(rng, 40, hf.vocab_size) for _ in range(3)]
    sequences = [fixed.new_sequence() for _ in streams]
    for sequence, stream, cached in zip(sequences, streams, (30, 5, 12), strict=True):
        sequence.extend(stream[:cached], keep=0)
    for round_ in range(2):
        parents = [-1, 0, 0] if round_ else None  # a tree in the second batch
        items = [Extend(sequences[0], streams[0][30 + 3 * round_:33 + 3 * round_], 3),
                 Extend(sequences[1], [streams[1][5 + round_]], 1),
                 Extend(sequences[2], streams[2][12 + 3 * round_:15 + 3 * round_], 3,
                        parents)]
        for item, logits in zip(items, fixed.extend_batch(items), strict=True):
            expected = hf.new_sequence()
            context = item.sequence.tokens[:len(item.sequence.tokens) - len(item.ids)]
            expected.extend(context, 0)
            assert difference(logits, expected.extend(item.ids, 3 if len(item.ids) == 3
                                                      else 1, item.parents)) < LOGIT_TOLERANCE
    lone = sequences[1].extend([7, 8])
    assert difference(lone, fresh(hf, sequences[1].tokens)[-2:]) < LOGIT_TOLERANCE
    many = [fixed.new_sequence() for _ in range(9)]
    for sequence, logits in zip(many, fixed.extend_batch(
            [Extend(sequence, [4 + i, 5], 1) for i, sequence in enumerate(many)]), strict=True):
        assert difference(logits, fresh(hf, sequence.tokens)[-1:]) < LOGIT_TOLERANCE
    prompt = tokens(rng, 100, hf.vocab_size)
    assert difference(fixed.new_sequence().extend(prompt, 1), fresh(hf, prompt)[-1:]) < \
        LOGIT_TOLERANCE
    assert interleaved_worst(fixed, hf) < LOGIT_TOLERANCE


def test_a_trees_accepted_path_is_copied_to_the_front(hf: HFBackend) -> None:
    backend = PagedBackend(hf, max_context=200)
    sequence = backend.new_sequence()
    sequence.extend(list(range(3, 3 + PAGE - 2)), keep=0)  # the tree crosses a page
    sequence.extend([20, 21, 22, 23], parents=[-1, -1, 1, 2])  # 20 | 21 -> 22 -> 23
    sequence.select(PAGE - 2, [PAGE - 1, PAGE])  # keep 21 and 22
    assert sequence.tokens == [*range(3, 3 + PAGE - 2), 21, 22]
    logits = sequence.extend([30])
    assert difference(logits, fresh(hf, [*range(3, 3 + PAGE - 2), 21, 22, 30])[-1:]) < \
        LOGIT_TOLERANCE


def test_pages_are_taken_as_a_sequence_grows_and_given_back(hf: HFBackend) -> None:
    backend = PagedBackend(hf, max_context=200)
    sequence = backend.new_sequence()
    sequence.extend(list(range(3, 3 + 2 * PAGE + 1)), 0)
    assert backend.kv_pages()[0] == 3
    sequence.truncate(PAGE)  # a rollback gives back the pages past the length
    assert backend.kv_pages()[0] == 1
    other = backend.new_sequence()
    other.extend([5, 6], 1)
    assert backend.kv_pages()[0] == 2
    del sequence, other
    gc.collect()
    assert backend.kv_pages() == (0, backend.pool.pages - 1)  # page 0 is padding's


def test_a_capped_pool_refuses_a_pass_it_cannot_hold_and_loses_nothing(
        hf: HFBackend) -> None:
    backend = PagedBackend(hf, max_context=200, pages=4)
    rng = np.random.default_rng(2)
    one, two = backend.new_sequence(), backend.new_sequence()
    held = tokens(rng, 2 * PAGE, hf.vocab_size)
    one.extend(held, 0)
    with pytest.raises(PoolFull, match="raise --max-kv-bytes"):
        backend.extend_batch([Extend(one, [7], 1), Extend(two, tokens(rng, 3 * PAGE, 99), 1)])
    assert backend.pool.pages == 5 and backend.kv_pages() == (2, 2)  # never grew, none lost
    assert two.tokens == [] and one.tokens == held  # neither pass happened
    assert np.abs(one.extend([7], 1) - fresh(hf, [*held, 7])[-1:]).max() < LOGIT_TOLERANCE


def test_an_uncapped_pool_grows_and_keeps_what_it_held(
        hf: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged, "INITIAL_PAGES", 2)
    backend = PagedBackend(hf, max_context=200)
    rng = np.random.default_rng(3)
    first = tokens(rng, PAGE + 3, hf.vocab_size)
    one = backend.new_sequence()
    one.extend(first, 0)
    backend.new_sequence().extend(tokens(rng, 5 * PAGE, hf.vocab_size), 0)  # grows
    assert backend.pool.pages >= 8
    one.reserve(len(first) + 3 * PAGE)  # outside a pass: the pool a pass grew takes writes
    assert backend.pool.limit > 0  # half the memory free at start
    assert np.abs(one.extend([9], 1) - fresh(hf, [*first, 9])[-1:]).max() < LOGIT_TOLERANCE


def test_an_uncapped_pool_stops_at_its_limit(hf: HFBackend) -> None:
    pool = PagePool(hf.kv_shape, hf.model.dtype, hf.device, 3, capped=False, limit=5)
    held = pool.take(4)  # from 2 pages, doubled to 5 (its limit), not 6 ...
    assert pool.pages == 6 and len(set(held)) == 4 and 0 not in held
    pool.take(1)
    with pytest.raises(PoolFull, match="set --max-kv-bytes"):
        pool.take(1)
    assert pool.used == 5 and pool.pages == 6


def test_pages_given_back_while_a_take_holds_the_lock_wait_for_the_next_take(
        hf: HFBackend) -> None:
    """The garbage collector may run a dropped sequence's finalizer on the model thread in
    the middle of a take: giving pages back must not wait for the lock (it would wait
    for itself)."""
    pool = PagePool(hf.kv_shape, hf.model.dtype, hf.device, 4, capped=True)
    held = pool.take(3)
    with pool._lock:  # as inside a take
        pool.give(held[:2])  # returns at once
    assert pool.free == 2 and sorted(pool.take(2)) == sorted(held[:2])


def test_a_batch_takes_each_sequence_once_and_passes_over_empty_items(hf: HFBackend) -> None:
    backend = PagedBackend(hf, max_context=200)
    one, two = backend.new_sequence(), backend.new_sequence()
    with pytest.raises(ValueError, match="each sequence once"):
        backend.extend_batch([Extend(one, [5], 1), Extend(one, [6], 1)])
    with pytest.raises(ValueError, match="keep must be"):
        backend.extend_batch([Extend(one, [5], 2)])
    assert one.tokens == [] and backend.kv_pages()[0] == 0  # refused before any page
    empty, logits = backend.extend_batch([Extend(one, [], 0), Extend(two, [5, 6], 2)])
    assert empty.shape == (0, hf.vocab_size) and one.tokens == []
    assert difference(logits, fresh(hf, [5, 6])) < LOGIT_TOLERANCE
    assert backend.extend_batch([]) == []


class SharingPool(PagePool):
    """A planted bug: every page taken is also given to the next taker."""

    def take(self, n: int) -> list[int]:
        taken = super().take(n)
        self.give(taken)
        return taken


def test_a_page_given_to_two_sequences_is_caught(hf: HFBackend) -> None:
    backend = PagedBackend(hf, max_context=200)
    assert interleaved_worst(backend, hf) < LOGIT_TOLERANCE
    backend.pool = SharingPool(hf.kv_shape, hf.model.dtype, hf.device, 64, capped=False)
    assert interleaved_worst(backend, hf) > 100 * LOGIT_TOLERANCE


def test_a_row_that_reads_past_its_length_after_a_rollback_is_caught(
        hf: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    attends = paged.attends

    def stale(length: int, n: int, parents: Sequence[int] | None
              ) -> tuple[np.ndarray, np.ndarray]:  # a planted bug: its whole last page
        visible, positions = attends(length, n, parents)
        seen = -(-(length + n) // PAGE) * PAGE
        wide = np.zeros((n, seen), dtype=bool)
        wide[:, :length + n] = visible
        wide[:, length + n:] = True
        return wide, positions

    backend = PagedBackend(hf, max_context=200)
    monkeypatch.setattr(paged, "attends", stale)
    assert interleaved_worst(backend, hf) > 100 * LOGIT_TOLERANCE


def test_what_a_pages_last_owner_left_never_reaches_the_next(hf: HFBackend) -> None:
    """A row reads its last page past its length (masked); NaN left there would poison
    attention all the same (0 x NaN), so a page is zeroed when taken."""
    backend = PagedBackend(hf, max_context=200)
    with torch.inference_mode():
        backend.pool.data.fill_(float("nan"))  # every page, free ones too
        backend.pool.data[:, :, 0] = 0  # (padding's is zeroed once, at start)
    assert interleaved_worst(backend, hf) < LOGIT_TOLERANCE


def test_the_runner_runs_a_transformers_target_on_the_paged_path_off_cuda(
        hf: HFBackend) -> None:
    config = RunnerConfig(max_kv_bytes=1 << 20, max_batched_tokens=64, max_batch=4)
    chosen = runner_path(hf, config, 300)
    assert isinstance(chosen, PagedBackend) and chosen.pool.capped
    page_bytes = PAGE * hf.kv_bytes_per_token
    assert chosen.pool.pages - 1 == pool_pages(config, hf.kv_bytes_per_token, PAGE) == \
        (1 << 20) // page_bytes + 64 // PAGE + 4
    assert not chosen.fixed  # fixed shapes are CUDA's (graphs)
    off, auto = (runner_path(hf, RunnerConfig(static=static), 300) for static in ("off", "auto"))
    assert isinstance(off, PagedBackend) and isinstance(auto, PagedBackend)
    assert not off.fixed and not auto.fixed and not auto.pool.capped
    on = runner_path(hf, RunnerConfig(static="on"), 300)
    assert isinstance(on, PagedBackend) and on.fixed
