"""Where a target step's time goes: the bare forward against the built-in runner's step.

For one target on one device, at a context of ``--context`` tokens, the median of
``--reps`` runs of each (milliseconds):

- ``forward``: the model's own forward over one new token after a transformers
  ``DynamicCache`` of the context (what any runner must at least pay, eagerly);
- ``replay`` (CUDA only): the paged path's captured graph of a one-position pass, replayed
  alone (what a runner can at least pay with graphs);
- ``eager step`` and ``eager verify 4``: the built-in runner's whole work for a cloud-only
  step (an empty draft: one token of the target's own) and for a 4-token draft, on the
  transformers backend's own cache (``run_verifications``: cache sync, forward, logits
  processing, verification, rollback);
- ``paged step`` and ``paged verify 4``: the same on the runner's packed, paged path
  (:mod:`spececd.backends.paged`);
- ``fixed step`` and ``fixed verify 4``: the same on its fixed shapes (graphs on CUDA).

The issue's target on a GPU: the runner's step at most 1.3x the bare forward replayed from a
graph. Usage::

    python scripts/step-cost.py models/target --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from spececd.backends.base import Backend
from spececd.backends.hf import HFBackend
from spececd.backends.paged import PagedBackend
from spececd.cloud.scheduler import run_verifications
from spececd.core.params import Mode, SamplingParams
from spececd.protocol.cloud_session import VerifyRequest


def median_ms(run: Callable[[], object], reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps + 3):  # three warm-ups
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times[3:]) * 1e3, 3)


def runner_step(backend: Backend, context: tuple[int, ...], draft: tuple[int, ...],
                reps: int, cuda: bool) -> float:
    sequence = backend.new_sequence()
    request = VerifyRequest(1, context, draft, None, Mode.GREEDY, SamplingParams(seed=0))
    run_verifications(backend, [(sequence, request)])  # the context's prefill
    return median_ms(lambda: run_verifications(backend, [(sequence, request)]), reps, cuda)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    hf = HFBackend(args.target, device=args.device, dtype=args.dtype, threads=args.threads)
    cuda = hf.device.type == "cuda"
    rng = np.random.default_rng(0)
    context = tuple(int(t) for t in rng.integers(0, hf.vocab_size, args.context))
    draft = context[:4]
    row: dict[str, object] = {"target": hf.description, "context": args.context}

    def bare() -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=hf.model.config)
        ids = torch.tensor([list(context)], device=hf.device)
        with torch.inference_mode():
            _, cache = hf.forward(cache, input_ids=ids)
            one = torch.tensor([[context[0]]], device=hf.device)

            def step() -> None:
                hf.forward(cache, input_ids=one)
                cache.crop(-1)

            row["forward"] = median_ms(step, args.reps, cuda)

    hf.thread.call(bare)
    row["eager step"] = hf.thread.call(runner_step, hf, context, (), args.reps, cuda)
    row["eager verify 4"] = hf.thread.call(runner_step, hf, context, draft, args.reps, cuda)
    for name, fixed in (("paged", False), ("fixed", True)):
        paged = PagedBackend(hf, max_context=max(512, args.context + 64), fixed=fixed)
        row[f"{name} step"] = hf.thread.call(runner_step, paged, context, (), args.reps, cuda)
        row[f"{name} verify 4"] = hf.thread.call(runner_step, paged, context, draft,
                                                 args.reps, cuda)
    if paged.graphs is not None:
        graphs = paged.graphs._graphs  # the one-position graph of the step
        graph = next(entry[0] for key, entry in graphs.items() if key[:2] == (1, 1))
        row["replay"] = median_ms(graph.replay, args.reps, cuda)
        row["graphs"] = len(graphs)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
