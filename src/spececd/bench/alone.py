"""The target alone, in this process, through SpecECD's own backend: the baseline that
``spececd demo`` measures beside speculative generation, on the same prompts, in the same
run, with the same runtime.

One forward pass per token on one cached sequence (the prompt's pass first), the token
chosen with the same processing the verifier uses (:func:`~spececd.core.sampling.
greedy_tokens`, or :func:`~spececd.core.sampling.process_logits` and a draw from the
verifier's random stream at each position). At temperature 0 its tokens are what
speculative generation gives for the same resolved parameters; sampled, they follow the
same distribution. A constraint masks every position as the verifier masks it
(:mod:`spececd.grammar`). It stops at the parameters' stop tokens and ``max_tokens``, as a
generation does, so both count the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from spececd.backends.base import Backend
from spececd.core.params import SamplingParams
from spececd.core.sampling import (
    VERIFIER_STREAM,
    greedy_tokens,
    process_logits,
    round_rng,
    sample,
)

__all__ = ["AloneRun", "generate_alone"]


@dataclass(frozen=True)
class AloneRun:
    token_ids: tuple[int, ...]
    wall_s: float  # from the prompt's pass to the last token, the prompt's pass included
    first_s: float  # from the prompt's pass to the first token

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0


def generate_alone(backend: Backend, prompt_ids: Sequence[int], params: SamplingParams
                   ) -> AloneRun:
    """Generate after ``prompt_ids`` with ``backend`` alone (``params`` resolved: a seed
    set, ``prompt_len`` the prompt's length)."""
    if params.seed is None:
        raise ValueError("the target alone runs with a concrete seed")
    sequence = backend.new_sequence()
    history = list(prompt_ids)
    tokens: list[int] = []
    start = time.perf_counter()
    first = 0.0
    logits = sequence.extend(history, keep=1)  # [1, vocab]
    matcher = None
    if params.constraint is not None:
        from spececd.grammar import grammars_for, mask_logits

        compiled = grammars_for(backend.tokenizer, backend.vocab_size).compile(params.constraint)
        matcher = compiled.matcher()
    while True:
        position = len(history)
        if matcher is not None:
            matcher.sync(history[params.prompt_len:])
            logits = mask_logits(logits, matcher.allowed_now()[None, :])
        if params.greedy:
            token = int(greedy_tokens(logits, params, history, position)[0])
        else:
            probs = process_logits(logits, params, history, position)[0]
            token = sample(probs, round_rng(params.seed, VERIFIER_STREAM, position))
        tokens.append(token)
        history.append(token)
        first = first or time.perf_counter()
        if (token in params.stop_token_ids or len(tokens) >= params.max_tokens
                or len(history) >= backend.max_context):
            break
        logits = sequence.extend([token], keep=1)
    return AloneRun(tuple(tokens), time.perf_counter() - start, first - start)
