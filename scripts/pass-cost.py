"""What one batched verification pass costs the built-in runner, against the bare forward.

``--rows`` sessions of ``--context`` cached tokens each verify ``--positions`` new ones in
one pass (plus, with ``--prompt N``, one more row bringing in an N-token prompt chunk);
the median of ``--reps`` passes, in milliseconds, of:

- ``runner``: the built-in runner's batched pass, ``extend_batch`` then the rollback of the
  new tokens (where :mod:`spececd.backends.paged` exists, its packed, paged pass; run with
  ``PYTHONPATH`` at an older checkout's ``src``, that checkout's transformers pass: the
  padded one that gathers every row's cache and copies it back);
- ``bare`` (paged checkouts only): the model's forward over the same packed tokens, each
  row attending to keys and values already in one contiguous tensor per layer: what the
  pass costs without pages (no writes into them, no reads from them).

Prints one JSON line. Usage::

    python scripts/pass-cost.py models/target --dtype float32 --rows 32 --positions 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from spececd.backends.base import Extend
from spececd.backends.hf import HFBackend


def median_ms(run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps + 2):  # two warm-ups
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times[2:]) * 1e3, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--positions", type=int, default=5)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prompt", type=int, default=0, help="one more row of this many")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    hf = HFBackend(args.model, device="cpu", dtype=args.dtype)
    try:
        from spececd.backends.paged import PagedBackend
        runner = PagedBackend(hf, args.context + max(args.positions, args.prompt) + 1)
    except ImportError:
        runner, PagedBackend = hf, None  # an older checkout: its padded pass
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, hf.vocab_size, n)]

    sequences = [runner.new_sequence() for _ in range(args.rows)]
    for sequence in sequences:
        sequence.extend(ids(args.context), 0)
    items = [Extend(sequence, ids(args.positions), args.positions) for sequence in sequences]
    if args.prompt:
        items.append(Extend(runner.new_sequence(), ids(args.prompt), 1))

    def runner_pass() -> None:
        runner.extend_batch(items)
        for item in items:
            item.sequence.truncate(len(item.sequence.tokens) - len(item.ids))

    result: dict[str, object] = {
        "runner": runner.name, "model": args.model, "dtype": args.dtype, "rows": args.rows,
        "positions": args.positions, "context": args.context, "prompt": args.prompt,
        "threads": torch.get_num_threads(),
        "runner_ms": hf.thread.call(lambda: median_ms(runner_pass, args.reps))}
    if PagedBackend is not None:
        result["bare_ms"] = hf.thread.call(lambda: median_ms(bare_pass(runner, items), args.reps))
        result["runner_over_bare"] = round(result["runner_ms"] / result["bare_ms"], 3)  # type: ignore[operator]
    print(json.dumps(result))


def bare_pass(runner: object, items: list[Extend]) -> Callable[[], None]:
    """The packed forward of ``items`` with every row's keys and values already gathered:
    the paged pass's layout and attention, its pages' writes and reads left out."""
    from spececd.backends import paged

    backend: paged.PagedBackend = runner  # type: ignore[assignment]
    lengths = [len(item.sequence.tokens) for item in items]
    counts = [len(item.ids) for item in items]
    own = [backend._own(item.sequence) for item in items]
    for sequence, length, n in zip(own, lengths, counts, strict=True):
        sequence.reserve(length + n)
    inputs, _ = backend._layout(items, own, lengths, backend._shape(lengths, counts))
    data, rows = backend.pool.data, inputs["mask"].shape[0]
    read = [[data[kind, layer].index_select(0, inputs["reads"])
             .view(rows, -1, *data.shape[4:]).transpose(1, 2).contiguous()
             for kind in (0, 1)] for layer in range(data.shape[1])]

    class Bare(paged.PackedPass):
        def pages(self, layer: int, key: torch.Tensor, value: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            return read[layer][0], read[layer][1]  # no writes, no reads: made beforehand

    @torch.inference_mode()
    def run() -> None:
        backend._run(inputs, Bare)

    return run


if __name__ == "__main__":
    main()
