"""Verification of one draft block: which drafted tokens to keep, and the token to add.

Terms (ARCHITECTURE §2):

- accepted: the drafted tokens kept, always a prefix of the block;
- correction: at the first rejected position, the token the verifier emits instead;
- bonus: when all ``k`` drafted tokens are accepted, one more token drawn from
  ``target_probs[k]``.

So every round emits ``num_accepted + 1`` tokens. Modes:

- ``exact`` (Leviathan et al. 2023, Algorithm 1): accept drafted ``x`` with probability
  ``min(1, target_probs[x] / draft_probs[x])``; the correction is drawn from
  ``norm(max(0, target_probs - draft_probs))``. Needs the drafter's distribution.
- ``match``: draw the verifier's own token from ``target_probs`` at each position and keep
  drafted tokens while they are equal; the first unequal draw is the correction.
- ``greedy``: ``match`` with one-hot ``target_probs`` (temperature 0), i.e. keep drafted
  tokens while they equal the target's argmax.

All three emit tokens distributed exactly as the target alone would. One more, for
experiments only, is LOSSY:

- ``threshold``: keep drafted tokens while ``target_probs[x] >= threshold``; the first one
  below it is replaced by the verifier's own draw from ``target_probs``. It keeps tokens the
  target finds merely plausible, so its output is not the target's distribution.

This module is pure: arrays and an explicit RNG in, a frozen result out.

The RNG is either one generator for the whole block or a function from the offset in the
block to a generator. The verifier passes the latter, keyed by absolute position, so that
position ``n``'s draws do not depend on where a block started: in ``match`` and ``greedy``
mode the output is then exactly the target-alone sample for the same seed, however the
tokens were split into blocks (or generated without a draft).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from spececd.core.sampling import Mode, SparseProbs, sample


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token: int  # the correction if num_accepted < k, else the bonus


def verify(
    draft_tokens: Sequence[int],  # [k]
    target_probs: np.ndarray,  # [k + 1, vocab]
    rng: np.random.Generator | Callable[[int], np.random.Generator],
    mode: Mode,
    draft_probs: Sequence[SparseProbs] | None = None,  # [k], required in exact mode
    threshold: float = 0.0,  # threshold mode only, in (0, 1]
) -> VerifyResult:
    k = len(draft_tokens)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k + 1, vocab] = [{k + 1}, V], "
                         f"got {target_probs.shape}")
    if mode is Mode.EXACT and (draft_probs is None or len(draft_probs) != k):
        raise ValueError("exact mode needs one draft distribution per drafted token")
    if mode is Mode.THRESHOLD and not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold mode needs a threshold in (0, 1], got {threshold}")

    def at(i: int) -> np.random.Generator:
        return rng if isinstance(rng, np.random.Generator) else rng(i)

    for i, token in enumerate(draft_tokens):
        gen = at(i)
        if mode is Mode.EXACT:
            assert draft_probs is not None
            target_p, draft_p = target_probs[i, token], draft_probs[i].prob_of(token)
            if gen.random() < min(1.0, target_p / draft_p):
                continue
            residual = np.maximum(target_probs[i] - draft_probs[i].dense(target_probs.shape[1]), 0)
            # A zero residual means target == draft here, where rejection has probability 0;
            # only rounding gets us here, and the target distribution is then the residual.
            correction = sample(residual if residual.sum() > 0 else target_probs[i], gen)
            return VerifyResult(num_accepted=i, next_token=correction)
        if mode is Mode.THRESHOLD:
            if target_probs[i, token] >= threshold:
                continue
            return VerifyResult(num_accepted=i, next_token=sample(target_probs[i], gen))
        own = sample(target_probs[i], gen)
        if own != token:
            return VerifyResult(num_accepted=i, next_token=own)
    return VerifyResult(num_accepted=k, next_token=sample(target_probs[k], at(k)))
