"""Exact stopping: never a token after a stop token, never more than ``max_tokens``.

A verdict may accept tokens past a stop token or past the token budget (the drafter and
verifier work in blocks); `clip_emitted` cuts a round's emitted tokens back to what the
target alone would have produced. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence


def clip_emitted(
    tokens: Sequence[int], stop_token_ids: Sequence[int], remaining: int
) -> tuple[list[int], bool]:
    """Return the tokens to emit (at most ``remaining``, up to and including the first stop
    token) and whether generation is finished."""
    out: list[int] = []
    for token in tokens:
        if len(out) == remaining:
            return out, True
        out.append(token)
        if token in stop_token_ids:
            return out, True
    return out, len(out) == remaining
