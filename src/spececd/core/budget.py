"""The server's token budget per pass: how many positions one batched verification pass may
compute, and which (docs/deploy/many-clients.md).

A pass computes, for each session in it, the context tokens the server's cache lacks (one,
the session's last token, for a session that is decoding; a whole prompt for one that just
joined) and the positions of its draft. While the batch is small a pass costs about the same
whatever it holds; once rows x positions fill the device it grows with every position, and
every session in the pass waits for it. So the server holds each pass to a budget of
positions:

- :class:`PassCost` fits what a pass costs on this runner, as it runs: ``seconds ~ base +
  per_row * rows + per_position * positions + per_context * context``, least squares over
  exponentially weighted passes. ``context`` is the cached tokens the rows read, the sum of
  their contexts (per row, not per query: a row of many positions, a prompt's chunk, does
  more attention over it than a row of one, which the fit averages over). Attention and
  the reads of keys and values grow with it: on the built-in runner in float32 here, a
  pass of 32 rows of one position each cost 47 ms over contexts of 8 tokens and 110 ms
  over contexts of 500, which a fit of rows and positions alone misprices as the
  sessions' contexts grow. A runtime that pads (the fixed shapes of
  CUDA graphs) is fitted the same way, by what its rows hold: it pads to at most 8 rows of
  64 positions, a pass a GPU computes for about the cost of one. With a latency aim, the
  budget is the most positions a pass of the rows queued may compute within it, or within
  :data:`HEADROOM` times what the sessions' tokens alone cost where those already take
  longer (a device full of rows still speculates where it pays): :meth:`PassCost.budget`.
- :func:`plan` then decides, before the pass, what each queued session gets. Every session
  that is decoding gets its token (the position after its context); a session still
  prefilling gets a chunk of its prompt, and no result until its prompt is in. Positions of
  drafts are taken in order of their worth, the chance that the position is reached and
  kept (the product of the session's acceptance by depth up to it,
  :class:`DepthAcceptance`), while they pay: a position worth less than what the pass's
  tokens per second already give per position's cost would lower them. Prompts' chunks
  fill the rest, a share of the budget kept for them so that joining is never starved.
- Lossless by construction: a leading prefix of a draft (:func:`cut_draft`), chosen from
  costs and past acceptance, verified as a shorter draft (a chain's first token past the
  cut decided from the last row, as an uncut verification decides it: the block ends
  where the edge put it). Whether a position is kept may depend on what precedes it,
  never on the pass's outputs nor on the token drafted there (not even the draft's own
  probability of that token where the token past the cut is left out, as in a cut tree:
  a position kept because of the token drawn there no longer holds a sample of the
  draft's distribution, which verification assumes; the draft's distribution there,
  before its draw, is fair). tests/core/test_budget.py plants such bugs.
- The budget bites only when the batch fills it: a pass whose whole work fits, or that
  holds one session, runs whole, within a cap from memory apart from the budget
  (``plan``'s ``cap``, ``max_batched_tokens``: prompts past it go in chunks).

:func:`plan` also returns the *level*: the least worth a verified position had to have. A
session's budget, told to its edge (the verdict's ``budget``), is the number of leading
positions of its own whose worth reaches the level (:meth:`DepthAcceptance.budget`), so the
edge drafts no positions that will be cut (except in exact mode with a fixed ``k``, whose
blocks a seed fixes only whole).

Pure: no clock, no I/O; the caller feeds measured seconds.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from spececd.core.sampling import SparseProbs

PRIOR_ACCEPT = 0.6  # a position's acceptance before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-rounds a session's estimate is shrunk over, toward its source's
PREFILL_SHARE = 0.5  # of a binding budget, kept for prompts' chunks while any wait
MIN_CHUNK = 32  # prompt tokens a pass prefills at least while any wait
START_BUDGET = 256  # positions per pass (auto) until the pass cost is fitted
FIT_PASSES = 8  # passes seen before the fit is used
MIN_SPREAD = 1.0  # variance of positions apart from rows (positions²) the fit needs
HEADROOM = 2.0  # a pass may take this many times its sessions' tokens alone, past the aim
AMORTISE = 4.0  # a prompt's chunk is at least this many times the positions a row's cost buys
# A pass that took more than this many times what the fit predicts is folded in as that
# many times: one stalled pass (its process descheduled or stopped, swapping) would
# otherwise hold the budget down for a hundred passes; a lasting change is still learned,
# a little slower (a cost up tenfold for good: predicted at 5.3x the old after 20 passes
# and 8.1x after 50, where unclipped 5.9x and 8.4x).
OUTLIER = 4.0


@dataclass
class PassCost:
    """A pass's seconds against its rows, positions and context, ``base + per_row * rows +
    per_position * positions + per_context * context`` (``context``: the cached tokens the
    pass's rows read, the sum of their contexts), by least squares over passes weighted by
    ``decay`` per pass (the newest weighs most). Coefficients are never negative: one that
    fits negative is left out and the rest refitted. ``error``: how far off its predictions
    were."""

    decay: float = 0.97
    passes: int = 0
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _coef: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _errors: np.ndarray = field(default_factory=lambda: np.zeros(2))  # sum, weight

    def update(self, rows: int, positions: int, seconds: float, context: int = 0) -> None:
        """Fold in one pass of ``rows`` sessions computing ``positions`` positions over
        ``context`` cached tokens (at most :data:`OUTLIER` times what the fit predicts, once
        fitted)."""
        if self.fitted and (predicted := self.predict(rows, positions, context)) > 0:
            if seconds > 0:
                self._errors = self.decay * self._errors + (abs(seconds - predicted) / seconds,
                                                            1.0)
            seconds = min(seconds, OUTLIER * predicted)
        x = np.array([1.0, rows, positions, context])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.passes += 1
        self._coef = self._solve()

    def _solve(self) -> np.ndarray:
        # Scaled to like magnitudes first (a context runs to thousands of tokens), so that
        # the ridge that keeps an unseen term at 0 never bends a seen one.
        scale = np.sqrt(np.maximum(np.diag(self._xx), 1e-12))
        active = [0, 1, 2, 3]
        while True:
            ix = np.ix_(active, active)
            xx = self._xx[ix] / np.outer(scale[active], scale[active]) + 1e-12 * np.eye(len(active))
            scaled = np.linalg.lstsq(xx, self._xy[active] / scale[active], rcond=None)[0]
            if scaled.min() >= 0 or len(active) == 1:
                coef = np.zeros(4)
                coef[active] = np.maximum(scaled / scale[active], 0.0)
                coef[coef * scale / max(scale[0], 1e-12) < 1e-9] = 0.0  # rounding, not a cost
                return coef
            # The most negative in seconds at its term's typical size, not per unit: a
            # context token's cost is a thousandth of a position's.
            active.pop(int(np.argmin(scaled)))

    @property
    def fitted(self) -> bool:
        """Whether enough passes were seen for the fit to be used, and they tell a
        position's cost from a row's: positions varied apart from rows (passes whose
        positions all follow their rows, as every session's token alone, leave the split
        to least squares' whim; a budget from it could cut every draft to nothing, and then
        no pass would ever teach it otherwise)."""
        if self.passes < FIT_PASSES:
            return False
        weight = self._xx[0, 0]
        mean = self._xx[0, 1:3] / weight
        cov = self._xx[1:3, 1:3] / weight - np.outer(mean, mean)
        rows_var, positions_var, both = cov[0, 0], cov[1, 1], cov[0, 1]
        apart = positions_var - (both * both / rows_var if rows_var > 1e-9 else 0.0)
        return bool(apart >= MIN_SPREAD)

    @property
    def error(self) -> float:
        """The fit's mean |seconds - predicted| / seconds over the passes since it was
        fitted (weighted as the fit is; 0 before)."""
        total, weight = self._errors
        return float(total / weight) if weight else 0.0

    @property
    def per_row(self) -> float:
        """Seconds one more row (a session, a chunk: on a runtime that evaluates each
        sequence on its own, a forward's fixed cost) adds to a pass."""
        return float(self._coef[1])

    @property
    def per_position(self) -> float:
        """Seconds one more position adds to a pass."""
        return float(self._coef[2])

    @property
    def per_context(self) -> float:
        """Seconds one more cached token read (attention over it, its keys and values
        read) adds to a pass."""
        return float(self._coef[3])

    def predict(self, rows: int, positions: int, context: int = 0) -> float:
        """Seconds a pass of ``rows`` sessions computing ``positions`` positions over
        ``context`` cached tokens costs."""
        return float(self._coef @ np.array([1.0, rows, positions, context]))

    def budget(self, rows: int, aim_s: float, context: int = 0) -> int | None:
        """Positions a pass of ``rows`` sessions over ``context`` cached tokens may compute:
        within ``aim_s`` seconds, or :data:`HEADROOM` times the pass of their tokens alone
        if that is longer (None: positions cost nothing)."""
        alone = self.predict(rows, rows, context)
        return self.positions_within(rows, max(aim_s, HEADROOM * alone), context)

    def positions_within(self, rows: int, seconds: float, context: int = 0) -> int | None:
        """The most positions a pass of ``rows`` sessions over ``context`` cached tokens
        may compute within ``seconds`` (at least ``rows``: every session's token); None
        when positions cost nothing."""
        if self.per_position <= 0:
            return None
        spare = seconds - self.predict(rows, 0, context)
        return max(rows, int(spare / self.per_position))


def pass_budget(token_budget: int | None, cost: PassCost, rows: int, aim_s: float,
                context: int = 0) -> int | None:
    """Positions a pass of ``rows`` sessions over ``context`` cached tokens may compute
    (None: no budget), for a ``token_budget`` of that many positions (0: none) or None
    (``auto``: from ``cost`` within ``aim_s``, :data:`START_BUDGET` until it is
    fitted)."""
    if token_budget is not None:
        return token_budget or None
    if not cost.fitted:
        return START_BUDGET
    return cost.budget(rows, aim_s, context)


@dataclass
class DepthAcceptance:
    """A session's acceptance by depth of its drafts: of the drafts verified as deep as
    depth ``i`` whose first ``i - 1`` tokens were kept, how many kept the ``i``-th,
    forgotten by ``decay`` per round. Shrunk toward ``prior`` (its draft source's, over
    every session; None: :data:`PRIOR_ACCEPT`, then each depth toward the one before)."""

    prior: DepthAcceptance | None = None
    decay: float = 0.95
    _kept: list[float] = field(default_factory=list)
    _reached: list[float] = field(default_factory=list)

    def observe(self, verified: int, accepted: int) -> None:
        """One round that verified ``verified`` leading positions and kept ``accepted`` (a
        round that verified none, a cloud-only step or a draft cut to nothing, teaches
        nothing and forgets nothing)."""
        if verified <= 0:
            return
        grow = verified - len(self._kept)
        if grow > 0:
            self._kept += [0.0] * grow
            self._reached += [0.0] * grow
        self._kept = [k * self.decay for k in self._kept]
        self._reached = [r * self.decay for r in self._reached]
        for i in range(min(verified, accepted + 1)):
            self._reached[i] += 1
            if i < accepted:
                self._kept[i] += 1
        if self.prior is not None:
            self.prior.observe(verified, accepted)

    def rates(self, depth: int) -> list[float]:
        """Estimated acceptance at each of the first ``depth`` positions, given the ones
        before it were kept."""
        base = self.prior.rates(depth) if self.prior is not None else None
        out, previous = [], PRIOR_ACCEPT
        for i in range(depth):
            prior = base[i] if base is not None else previous
            kept = self._kept[i] if i < len(self._kept) else 0.0
            reached = self._reached[i] if i < len(self._reached) else 0.0
            previous = (kept + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)
            out.append(previous)
        return out

    def worth(self, depth: int) -> list[float]:
        """The worth of each of the first ``depth`` positions: the chance that it is
        reached and kept."""
        out, survive = [], 1.0
        for rate in self.rates(depth):
            survive *= rate
            out.append(survive)
        return out

    def budget(self, level: float, most: int) -> int:
        """How many leading positions (at most ``most``) are worth at least ``level``."""
        if level <= 0:
            return most
        return sum(1 for w in self.worth(most) if w >= level)


@dataclass(frozen=True)
class Offer:
    """One queued verification as :func:`plan` sees it: ``prefill`` context tokens the
    server's cache lacks before the last one (0 for a session decoding), whether they may
    be split into chunks (``chunkable``), and its draft: ``worth[j]`` of depth ``j + 1``
    and ``nodes[j]`` the positions verifying it as deep as ``j + 1`` computes (``j + 1``
    for a chain; a tree's nodes of at most that depth), as charged (:func:`tree_nodes`);
    ``context``: the tokens of its context the server's cache holds, which the pass reads.

    A draft's length, and every ``nodes`` that decides a cut, must be fixed before the
    draft's tokens are sampled: a cut that depends on a token drawn at the depth it keeps
    is not lossless (module docstring)."""

    prefill: int
    worth: tuple[float, ...]
    nodes: tuple[int, ...]
    chunkable: bool = True
    context: int = 0

    @property
    def whole(self) -> int:
        """Positions the whole request computes: its new context and its whole draft."""
        return self.prefill + 1 + (self.nodes[-1] if self.nodes else 0)


@dataclass(frozen=True)
class Plan:
    """What a pass does with each offer: ``depths[i]`` leading draft positions verified, or
    None when it only prefills ``chunks[i]`` context tokens (and answers nothing yet);
    ``level``: the least worth a verified position had to have (0: the budget did not
    bind)."""

    depths: tuple[int | None, ...]
    chunks: tuple[int, ...]
    level: float

    def positions(self, offers: Sequence[Offer]) -> int:
        """Positions the pass computes."""
        total = 0
        for offer, depth, chunk in zip(offers, self.depths, self.chunks, strict=True):
            total += chunk if depth is None else offer.prefill + 1 + _nodes(offer, depth)
        return total


def _nodes(offer: Offer, depth: int) -> int:
    return offer.nodes[depth - 1] if depth > 0 else 0


def plan(offers: Sequence[Offer], budget: int | None, cost: PassCost | None = None,
         cap: int | None = None) -> Plan:
    """Within ``budget`` positions (None: no budget), what each of ``offers`` gets (see the
    module docstring); ``cost``, when fitted, stops drafts' positions where they no longer
    pay. Every offer not prefilling gets its token, whatever the budget.

    ``cap``: the most positions any pass computes, whatever else (None: none): a bound
    from memory, apart from the budget's latency (vLLM's ``max_num_batched_tokens``).
    Where the pass would run whole past it (one prompt, or prompts with nobody decoding)
    prompts go in chunks within it, first come first served; elsewhere the budget is held
    to it (drafts cut by worth, losslessly, as the budget cuts them). Every session
    decoding still gets its token, and a prompt that may not be split goes whole."""
    whole = Plan(tuple(len(o.nodes) for o in offers), (0,) * len(offers), 0.0)
    total = sum(o.whole for o in offers)
    over = cap is not None and total > cap
    if not over and (budget is None or len(offers) <= 1 or total <= budget):
        return whole
    if cap is not None:
        budget = cap if budget is None else min(budget, cap)
    assert budget is not None
    joining = [i for i, o in enumerate(offers) if o.prefill > 0 and o.chunkable]
    deciding = [i for i in range(len(offers)) if i not in joining]
    if not deciding:  # nobody decoding waits on the prompts: chunks would only cost more,
        return _prompts(offers, budget) if over else whole  # past a cap
    fitted = cost is not None and cost.fitted and cost.per_position > 0
    least_chunk = MIN_CHUNK
    if fitted:  # a chunk long enough that its forward's fixed cost is a small part of it
        assert cost is not None
        least_chunk = max(least_chunk, int(AMORTISE * cost.per_row / cost.per_position))
    used = sum(offers[i].prefill + 1 for i in deciding)  # every session's token
    waiting = sum(offers[i].prefill + 1 for i in joining)
    spare = max(0, budget - used)
    kept = min(waiting, max(least_chunk, int(PREFILL_SHARE * spare))) if joining else 0
    drafts = max(0, spare - kept)
    context = sum(offers[i].context for i in deciding)
    pays = (functools.partial(_pays, cost, len(deciding), context)
            if cost is not None and fitted else None)
    depths, positions, least, passed = _by_worth(offers, deciding, drafts, used, pays)
    # The level: the least worth verified (a session's positions of at least that worth are
    # what the planner takes first); nothing verified, just above the most worth left out.
    level = (float(least) if least < np.inf
             else float(np.nextafter(passed, np.inf)) if passed else 0.0)
    # Prompts: whole where they fit, else a chunk, first come first served.
    room = max(budget - positions, kept) if joining else 0
    if cap is not None:
        room = min(room, max(0, cap - positions))
    out_depths: list[int | None] = [depths.get(i) for i in range(len(offers))]
    chunks = [0] * len(offers)
    for i in joining:
        offer = offers[i]
        if offer.whole <= room:
            out_depths[i] = len(offer.nodes)
            room -= offer.whole
        elif room >= min(least_chunk, offer.prefill):  # no chunk too short to pay
            chunks[i] = min(offer.prefill, room)
            room -= chunks[i]
    return Plan(tuple(out_depths), tuple(chunks), level)


def _prompts(offers: Sequence[Offer], cap: int) -> Plan:
    """:func:`plan` for prompts alone (every offer a prompt that may be split) past a
    ``cap``: each whole while it fits, else a chunk of what is left, first come first
    served."""
    depths: list[int | None] = [len(o.nodes) for o in offers]
    chunks = [0] * len(offers)
    room = cap
    for i, offer in enumerate(offers):
        if offer.whole <= room:
            room -= offer.whole
            continue
        depths[i] = None  # a chunk, or no room: the next pass
        chunks[i] = max(0, min(offer.prefill, room))
        room -= chunks[i]
    return Plan(tuple(depths), tuple(chunks), 0.0)


def _pays(cost: PassCost, rows: int, context: int, worth: float, step: int, tokens: float,
          positions: int) -> bool:
    """Whether ``worth`` tokens for ``step`` more positions raise the tokens per second
    of a pass of ``rows`` sessions reading ``context`` cached tokens (``tokens`` so far, in
    ``positions``)."""
    rate = tokens / max(cost.predict(rows, positions, context), 1e-9)
    return worth >= rate * cost.per_position * step


def _by_worth(offers: Sequence[Offer], deciding: list[int], drafts: int, used: int,
              pays: Callable[[float, int, float, int], bool] | None
              ) -> tuple[dict[int, int], int, float, float]:
    """Drafts' positions by worth, each session's in order (its worth never grows with
    depth), while they fit ``drafts`` more positions and pay: each session's depth, the
    positions computed, the least worth taken and the most left out."""
    depths = dict.fromkeys(deciding, 0)
    heap = [(-offers[i].worth[0] / offers[i].nodes[0], i) for i in deciding if offers[i].nodes]
    heapq.heapify(heap)
    tokens, positions = float(len(deciding)), used
    least, passed = np.inf, 0.0
    while heap:
        _, i = heapq.heappop(heap)
        offer, depth = offers[i], depths[i]
        step = offer.nodes[depth] - _nodes(offer, depth)
        worth = offer.worth[depth]
        if step > drafts:
            passed = max(passed, worth)
            continue  # this session's next depth does not fit; shallower ones may
        if pays is not None and not pays(worth, step, tokens, positions):
            passed = max(passed, worth)
            break  # no position left is worth its cost
        depths[i] = depth + 1
        least = min(least, worth)
        drafts -= step
        positions += step
        tokens += worth
        if depth + 1 < len(offer.nodes):
            heapq.heappush(heap, (-offer.worth[depth + 1] / (offer.nodes[depth + 1]
                                                              - offer.nodes[depth]), i))
    return depths, positions, float(least), passed


def cut_draft(tokens: Sequence[int], draft_probs: Sequence[SparseProbs] | None,
              parents: Sequence[int] | None, depth: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None, tuple[int, ...] | None,
                         tuple[int, ...]]:
    """A draft's leading ``depth`` positions (``depth`` short of the draft's): a chain's
    first ``depth`` tokens and the one after them, to be verified cut (the last decided at
    the last row, :func:`~spececd.core.verify.verify`, so that the block ends where the
    edge put it), or a tree's nodes at most ``depth`` deep (their order kept, parents
    renumbered); and the kept nodes' indices in the whole draft (``kept[j]``: the cut
    draft's node ``j``), which turn a verified cut tree's accepted path back into the
    draft's numbering (a tree's nodes need only follow their parents, so a cut may keep a
    later node and drop an earlier one). Verifying it is verifying a draft that never went
    further: lossless whenever ``depth`` is chosen without the verification's outcome."""
    if parents is None:
        n = min(depth + 1, len(tokens))
        return (tuple(tokens[:n]), tuple(draft_probs[:n]) if draft_probs is not None else None,
                None, tuple(range(n)))
    levels = _levels(parents)
    kept: list[int] = []
    index: dict[int, int] = {}
    for i in range(len(parents)):
        if levels[i] <= depth:
            index[i] = len(kept)
            kept.append(i)
    return (tuple(tokens[i] for i in kept),
            tuple(draft_probs[i] for i in kept) if draft_probs is not None else None,
            tuple(index[parents[i]] if parents[i] >= 0 else -1 for i in kept), tuple(kept))


def tree_nodes(parents: Sequence[int] | None, size: int, drawn: bool = False
               ) -> tuple[int, ...]:
    """For a draft of ``size`` tokens (a tree with ``parents``), the positions verifying
    it as deep as ``1, 2, ...`` computes: :attr:`Offer.nodes`.

    ``drawn``: the tree was sampled for exact verification, where how many siblings a
    level holds is set by the token drawn there (the edge draws siblings while the mass
    left beside it is worth a node). A cut that weighs a level by its size would then keep
    it or not by its draw, and is not lossless (q = (0.9, 0.1), p = (0.5, 0.5): the kept
    level is the one whose draw was the likely token; 0.55 for it where the target gives
    0.5). Such a tree is charged one position a level, a cost fixed before its draws, as a
    chain of its depth: its siblings ride outside the budget (at most its width less one a
    level), and the pass's count of what it computed, which the fit reads, holds them."""
    if parents is None or drawn:
        depth = size if parents is None else max(_levels(parents), default=0)
        return tuple(range(1, depth + 1))
    levels = _levels(parents)
    deepest = max(levels, default=0)
    counts = np.bincount(levels, minlength=deepest + 1)[1:]
    return tuple(int(c) for c in np.cumsum(counts))


def _levels(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1: a child of the context's last token)."""
    levels: list[int] = []
    for parent in parents:
        levels.append(1 if parent < 0 else levels[parent] + 1)
    return levels

