# mypy: disable-error-code="no-untyped-call"
# (transformers and tokenizers ship without complete type hints)
"""What tests compare SpecECD's output against, shared by the test modules that need it:
transformers' own greedy generation, the exact distribution of a pair of sampled tokens,
the prompts the end-to-end tests use, and the logits tolerance of the backend suites.

torch and transformers are imported only when a reference is computed.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from spececd.core.params import SamplingParams
from spececd.core.sampling import process_logits

PROMPTS = ["def parse(line):\n    ", "import os\n\nclass ", "    for key, value in ",
           "\"\"\"Utilities for ", "x = [i * i for i in "]

# Float32 on CPU: incremental, batched and full passes differ only by summation order
# (measured ~3e-7 on the tiny models).
LOGIT_TOLERANCE = 1e-4

# Sampled runs that must repeat exactly for a seed use a fixed k and a fixed strategy: in
# exact mode a token's value depends on whether its position was drafted or was the bonus,
# and k=auto places those boundaries from live timings; proactive "auto" (the default
# against a server) switches to stream drafting, verified by match, by live timings too.
FIXED_K = 4


def hf_greedy(model_dir: Path, ids: list[int], max_new_tokens: int,
              dtype: str = "float32") -> list[int]:
    """The reference: transformers' own greedy generation in ``dtype``, no stop token.
    Computed once per model folder (as last written), dtype, prompt and length."""
    written = max(f.stat().st_mtime_ns for f in Path(model_dir).iterdir())
    return list(_greedy(Path(model_dir), written, tuple(ids), max_new_tokens, dtype))


@functools.lru_cache(maxsize=4)
def _reference_model(model_dir: Path, written: int, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def hf_logits(model_dir: Path, ids: list[int], dtype: str = "float32") -> np.ndarray:
    """The target's logits after ``ids`` (``[vocab]``), a fresh forward in ``dtype``."""
    import torch

    written = max(f.stat().st_mtime_ns for f in Path(model_dir).iterdir())
    with torch.no_grad():
        logits = _reference_model(Path(model_dir), written, dtype)(torch.tensor([ids])).logits
    return logits[0, -1].float().numpy()  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1024)  # modules check the same prompts of the default pair
def _greedy(model_dir: Path, written: int, ids: tuple[int, ...], max_new_tokens: int,
            dtype: str = "float32") -> tuple[int, ...]:
    import torch

    out = _reference_model(model_dir, written, dtype).generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(ids):].tolist())


def hf_greedy_healed(model_dir: Path, ids: list[int], allowed: tuple[int, ...],
                     max_new_tokens: int) -> list[int]:
    """The reference for a healed prompt (:mod:`spececd.healing`): transformers' own greedy
    generation after ``ids`` (the prompt without its last token), the first token the most
    likely of ``allowed`` alone, no stop token."""
    import torch

    written = max(f.stat().st_mtime_ns for f in Path(model_dir).iterdir())
    model = _reference_model(Path(model_dir), written)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    first = max(allowed, key=lambda token: float(logits[token]))
    return [first, *hf_greedy(model_dir, [*ids, first], max_new_tokens - 1)]


def exact_pair_distribution(target: Path, prompt: list[int], params: SamplingParams,
                            dtype: str = "float32"
                            ) -> np.ndarray:  # [V * V]: P(first = a, second = b)
    import torch

    from spececd.backends.registry import load_backend

    backend = load_backend(str(target), device="cpu", dtype=dtype)
    model = backend.model  # type: ignore[attr-defined]
    vocab = backend.vocab_size
    params = replace(params, prompt_len=len(prompt))  # penalties count what follows it
    with torch.no_grad():  # the tokenizer's ids only: a padded model's extra rows are none
        first = process_logits(
            model(torch.tensor([prompt])).logits[0, -1:, :vocab].float().numpy(), params,
            prompt, len(prompt))[0]
        batch = torch.tensor([[*prompt, a] for a in range(vocab)])
        rows = model(batch).logits[:, -1, :vocab].float().numpy()
        second = np.stack([process_logits(rows[a:a + 1], params, [*prompt, a],
                                          len(prompt) + 1)[0] for a in range(vocab)])
    return (first[:, None] * second).reshape(-1)  # type: ignore[no-any-return]


def hf_logprobs(model_dir: Path, ids: list[int]) -> np.ndarray:  # [len(ids), vocab]
    """The reference for log-probabilities: one plain transformers forward pass over
    ``ids`` and ``log_softmax`` in float64; row ``i`` is the distribution after
    ``ids[:i + 1]``."""
    import torch

    written = max(f.stat().st_mtime_ns for f in Path(model_dir).iterdir())
    with torch.no_grad():
        logits = _reference_model(Path(model_dir), written)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).numpy()  # type: ignore[no-any-return]
