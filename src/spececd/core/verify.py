"""Verification of one draft block: which drafted tokens to keep, and the token to add.

Terms (docs/how-it-works.md, "Terms"):

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

A block may be a **tree** of candidates (Sequoia, SpecInfer): ``parents[i]`` is the node
that drafted token ``i`` follows, ``-1`` for the context's last token, each parent before
its children. ``target_probs`` row 0 is the distribution after the context and row
``i + 1`` the one after node ``i``'s path. Verification walks down from the root: at a
node it decides among the children in order, follows the one it keeps, and stops with
the verifier's own token where it keeps none. A chain (``parents = None``) is the tree
whose every node has one child. Per mode, at a node with children ``c_1, c_2, ...``:

- ``match``/``greedy``: draw the verifier's token from the node's ``target_probs``; follow
  the first child equal to it, else emit it. Token ids only; duplicates are harmless.
- ``exact`` (recursive rejection): child ``c_j`` carries ``draft_probs[c_j]``, the
  distribution it was drawn from given its earlier siblings (the same distribution drawn
  with replacement, or without the earlier siblings' tokens without replacement). Accept
  it with probability ``min(1, P(x) / q_j(x))``; after a rejection ``P`` becomes
  ``norm(max(0, P - q_j))``; when every child is rejected, emit a draw from ``P``. By
  induction over the children, the emitted token follows the node's ``target_probs``.
- ``threshold``: follow the first child the target gives at least ``threshold``.

A chain the server's budget cut (``cut``) keeps its first token past the cut: that
token's position is the last row's, decided there like any other (kept or replaced), and
with no row after it the token decided there is the verifier's own, whichever it is. An
exact-mode draw at a position depends on whether a drafted token stands there, so deciding
the token past the cut as an uncut block would keeps the block's end where the edge put
it: a seeded sample is the same whatever the server cut.

At temperature 0 every row is a point mass, and ``target_probs`` may be given as the
target's tokens instead, ``[n + 1]`` integers (``[n]`` cut): every mode then keeps the
drafted tokens equal to them (the same result as with one-hot rows, in any mode), with no
distribution built and no random draw.

This module is pure: arrays and an explicit RNG in, a frozen result out.

The RNG is either one generator for the whole block or a function from the depth in the
block to a generator. The verifier passes the latter, keyed by absolute position, so that
position ``n``'s draws do not depend on where a block started: in ``match`` and ``greedy``
mode the output is then exactly the target-alone sample for the same seed, however the
tokens were split into blocks, or branched into trees (or generated without a draft).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from spececd.core.params import Mode
from spececd.core.sampling import SparseProbs, sample


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    # The correction where a node's children were all rejected, else the bonus (a cut
    # chain's: its last token, decided, whether kept or replaced)
    next_token: int
    path: tuple[int, ...] | None = None  # trees: the accepted nodes, root first


def check_tree(parents: Sequence[int], size: int) -> None:
    """Raise ``ValueError`` unless ``parents`` ``[size]`` is a tree in node order."""
    if len(parents) != size:
        raise ValueError(f"a tree of {size} nodes needs {size} parents, got {len(parents)}")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}'s parent must be -1 or an earlier node, got {parent}")


def tree_paths(parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Each node's path from the root, itself last: the drafted tokens its row follows."""
    paths: list[tuple[int, ...]] = []
    for i, parent in enumerate(parents):
        paths.append((*paths[parent], i) if parent >= 0 else (i,))
    return paths


def tree_depth(parents: Sequence[int]) -> int:
    """The longest path's length: the drafted positions a tree covers."""
    return max(map(len, tree_paths(parents)), default=0)


def verify(
    draft_tokens: Sequence[int],  # [n]
    target_probs: np.ndarray,  # [n + 1, vocab], or the target's tokens [n + 1] ([n] cut)
    rng: np.random.Generator | Callable[[int], np.random.Generator],
    mode: Mode,
    draft_probs: Sequence[SparseProbs] | None = None,  # [n], required in exact mode
    threshold: float = 0.0,  # threshold mode only, in (0, 1]
    parents: Sequence[int] | None = None,  # [n]: a tree; None: a chain
    cut: bool = False,  # a chain cut before its last token: target_probs has n rows
) -> VerifyResult:
    """Verify one drafted block (a chain, or a tree with ``parents``) against
    ``target_probs`` in ``mode``: the accepted tokens (a path from the root for a tree) and
    the verifier's own token, the correction or the bonus (``cut``: the last token decided,
    kept or replaced). Raises ``ValueError`` on shapes that do not match."""
    n = len(draft_tokens)
    rows = n if cut else n + 1
    points = target_probs.ndim == 1 and np.issubdtype(target_probs.dtype, np.integer)
    if cut and (parents is not None or n == 0):
        raise ValueError("only a chain of at least one token is verified cut")
    if target_probs.shape[0] != rows or not (points or target_probs.ndim == 2):
        raise ValueError(f"target_probs must be [{'n' if cut else 'n + 1'}, vocab] = "
                         f"[{rows}, V], or the target's [{rows}] tokens, "
                         f"got {target_probs.shape}")
    if mode is Mode.EXACT and (draft_probs is None or len(draft_probs) != n):
        raise ValueError("exact mode needs one draft distribution per drafted token")
    if mode is Mode.THRESHOLD and not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold mode needs a threshold in (0, 1], got {threshold}")
    children: list[list[int]] = [[] for _ in range(n + 1)]  # by row: node + 1
    if parents is None:
        for i in range(n):
            children[i].append(i)
    else:
        check_tree(parents, n)
        for i, parent in enumerate(parents):
            children[parent + 1].append(i)

    def at(depth: int) -> np.random.Generator:
        return rng if isinstance(rng, np.random.Generator) else rng(depth)

    path: list[int] = []
    row = 0  # the node reached, as its row in target_probs
    while True:
        chosen = emitted = None
        if points:
            emitted = int(target_probs[row])
        else:
            gen, probs = at(len(path)), target_probs[row]
            if mode is Mode.EXACT:
                assert draft_probs is not None
                mass = 1.0  # probs is P times mass: a residual is left unnormalised
                for child in children[row]:
                    token, dist = draft_tokens[child], draft_probs[child]
                    if gen.random() < min(1.0, probs[token] / mass / dist.prob_of(token)):
                        chosen = child
                        break
                    residual = np.maximum(probs / mass - dist.dense(target_probs.shape[1]), 0)
                    # A zero residual means P == q here, where rejection has probability 0;
                    # only rounding gets here, and P is then the residual.
                    if residual.sum() > 0:
                        probs, mass = residual, float(residual.sum())
            elif mode is Mode.THRESHOLD:
                chosen = next((c for c in children[row] if probs[draft_tokens[c]] >= threshold),
                              None)
            else:
                emitted = sample(probs, gen)
        if emitted is not None:  # match: follow the first child equal to the target's token
            chosen = next((c for c in children[row] if draft_tokens[c] == emitted), None)
        if chosen is None:
            token = sample(probs, gen) if emitted is None else emitted
            return VerifyResult(len(path), token, None if parents is None else tuple(path))
        if chosen + 1 == rows:  # kept past the cut: no row to go on with
            return VerifyResult(len(path), draft_tokens[chosen])
        path.append(chosen)
        row = chosen + 1
