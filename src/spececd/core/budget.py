"""The server's token budget per pass: how many positions one batched verification pass may
compute, and which (docs/deploy/many-clients.md).

A pass computes, for each session in it, the context tokens the server's cache lacks (one,
the session's last token, for a session that is decoding; a whole prompt for one that just
joined) and the positions of its draft. While the batch is small a pass costs about the same
whatever it holds; once rows x positions fill the device it grows with every position, and
every session in the pass waits for it. So the server holds each pass to a budget of
positions:

- :class:`PassCost` fits what a pass costs on this runner, as it runs: ``seconds ~ base +
  per_row * rows + per_position * positions``, least squares over exponentially weighted
  passes. With a latency aim, the budget is the most positions a pass of the rows queued
  may compute within it, or within :data:`HEADROOM` times what the sessions' tokens alone
  cost where those already take longer (a device full of rows still speculates where it
  pays): :meth:`PassCost.budget`.
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
- A runtime that pads every row of a forward to the longest (transformers' batched pass,
  the static path: ``Backend.padded``) computes rows x the longest row, whatever the
  others' lengths: positions are counted so (:func:`cells`) in the fit and the budget,
  drafts are cut to one depth for every session (a depth pays when its positions' worth
  together does), and a prompt goes whole beside sessions decoding only within the
  pass's width. Counted as a sum there, a prompt riding in a pass of 32 rows looked like
  200 positions while it cost 6,400, and the fit charged a position 2 ms where one costs
  0.5 (bench load, 64 replay clients): the budget cut drafts that paid, and cut them row
  by row, which saves nothing on such a runtime.

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
    """A pass's seconds against its rows and positions, ``base + per_row * rows +
    per_position * positions``, by least squares over passes weighted by ``decay`` per
    pass (the newest weighs most). Coefficients are never negative: one that fits negative
    is left out and the rest refitted. ``error``: how far off its predictions were."""

    decay: float = 0.97
    passes: int = 0
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _coef: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _errors: np.ndarray = field(default_factory=lambda: np.zeros(2))  # sum, weight

    def update(self, rows: int, positions: int, seconds: float) -> None:
        """Fold in one pass of ``rows`` sessions computing ``positions`` positions (at most
        :data:`OUTLIER` times what the fit predicts, once fitted)."""
        if self.fitted and (predicted := self.predict(rows, positions)) > 0:
            if seconds > 0:
                self._errors = self.decay * self._errors + (abs(seconds - predicted) / seconds,
                                                            1.0)
            seconds = min(seconds, OUTLIER * predicted)
        x = np.array([1.0, rows, positions])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.passes += 1
        self._coef = self._solve()

    def _solve(self) -> np.ndarray:
        active = [0, 1, 2]
        while True:
            xx = self._xx[np.ix_(active, active)] + 1e-9 * np.eye(len(active))
            solved = np.linalg.lstsq(xx, self._xy[active], rcond=None)[0]
            if solved.min() >= 0 or len(active) == 1:
                coef = np.zeros(3)
                coef[active] = np.maximum(solved, 0.0)
                coef[coef < 1e-9] = 0.0  # under a nanosecond: rounding, not a cost
                return coef
            active.pop(int(np.argmin(solved)))

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
        mean = self._xx[0, 1:] / weight
        cov = self._xx[1:, 1:] / weight - np.outer(mean, mean)
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

    def predict(self, rows: int, positions: int) -> float:
        """Seconds a pass of ``rows`` sessions computing ``positions`` positions costs."""
        return float(self._coef @ np.array([1.0, rows, positions]))

    def budget(self, rows: int, aim_s: float) -> int | None:
        """Positions a pass of ``rows`` sessions may compute: within ``aim_s`` seconds, or
        :data:`HEADROOM` times the pass of their tokens alone if that is longer (None:
        positions cost nothing)."""
        return self.positions_within(rows, max(aim_s, HEADROOM * self.predict(rows, rows)))

    def positions_within(self, rows: int, seconds: float) -> int | None:
        """The most positions a pass of ``rows`` sessions may compute within ``seconds``
        (at least ``rows``: every session's token); None when positions cost nothing."""
        if self.per_position <= 0:
            return None
        spare = seconds - float(self._coef[0] + self._coef[1] * rows)
        return max(rows, int(spare / self.per_position))


def pass_budget(token_budget: int | None, cost: PassCost, rows: int, aim_s: float) -> int | None:
    """Positions a pass of ``rows`` sessions may compute (None: no budget), for a
    ``token_budget`` of that many positions (0: none) or None (``auto``: from ``cost``
    within ``aim_s``, :data:`START_BUDGET` until it is fitted)."""
    if token_budget is not None:
        return token_budget or None
    if not cost.fitted:
        return START_BUDGET
    return cost.budget(rows, aim_s)


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
    for a chain; a tree's nodes of at most that depth), as charged (:func:`tree_nodes`).

    A draft's length, and every ``nodes`` that decides a cut, must be fixed before the
    draft's tokens are sampled: a cut that depends on a token drawn at the depth it keeps
    is not lossless (module docstring)."""

    prefill: int
    worth: tuple[float, ...]
    nodes: tuple[int, ...]
    chunkable: bool = True

    @property
    def whole(self) -> int:
        """Positions the whole request computes: its new context and its whole draft."""
        return self.prefill + 1 + (self.nodes[-1] if self.nodes else 0)


@dataclass(frozen=True)
class Plan:
    """What a pass does with each offer: ``depths[i]`` leading draft positions verified, or
    None when it only prefills ``chunks[i]`` context tokens (and answers nothing yet); both
    when a chunk brings in the rest of its prompt, in the chunks' forward, before the
    verifications' forward verifies the rest (a padded runtime's prompts);
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


def cells(counts: Sequence[int], padded: bool) -> int:
    """Positions one forward over rows of ``counts`` new tokens computes: their sum, or on
    a runtime that pads every row to the longest (``padded``), rows x the longest."""
    if not counts:
        return 0
    return len(counts) * max(counts) if padded else sum(counts)


def plan(offers: Sequence[Offer], budget: int | None, cost: PassCost | None = None,
         padded: bool = False, cap: int | None = None) -> Plan:
    """Within ``budget`` positions (None: no budget), what each of ``offers`` gets (see the
    module docstring); ``cost``, when fitted, stops drafts' positions where they no longer
    pay. Every offer not prefilling gets its token, whatever the budget.

    ``cap``: the most positions any pass computes, whatever else (None: none): a bound
    from memory, apart from the budget's latency (vLLM's ``max_num_batched_tokens``).
    Where the pass would run whole past it (one prompt, or prompts with nobody decoding)
    prompts go in chunks within it, first come first served; elsewhere the budget is held
    to it (drafts cut by worth, losslessly, as the budget cuts them). Every session
    decoding still gets its token, and a prompt that may not be split goes whole.

    ``padded``: the runtime pads every row of a forward to the longest (:func:`cells`), so
    a position costs nothing below the pass's width and a whole row of them above it.
    Drafts are then taken depth by depth across every session (a depth pays when the worth
    of all its positions does), and a prompt goes whole beside sessions decoding only
    within the pass's width (wider, it would pad each of their rows to its length): else
    it is prefilled in chunks, in a forward of their own."""
    whole = Plan(tuple(len(o.nodes) for o in offers), (0,) * len(offers), 0.0)
    total = cells([o.whole for o in offers], padded)
    over = cap is not None and total > cap
    if not over and (budget is None or len(offers) <= 1 or total <= budget):
        return whole
    if cap is not None:
        budget = cap if budget is None else min(budget, cap)
    assert budget is not None
    joining = [i for i, o in enumerate(offers) if o.prefill > 0 and o.chunkable]
    deciding = [i for i in range(len(offers)) if i not in joining]
    if not deciding:  # nobody decoding waits on the prompts: chunks would only cost more,
        return _prompts(offers, budget, padded) if over else whole  # past a cap
    fitted = cost is not None and cost.fitted and cost.per_position > 0
    least_chunk = MIN_CHUNK
    if fitted:  # a chunk long enough that its forward's fixed cost is a small part of it
        assert cost is not None
        least_chunk = max(least_chunk, int(AMORTISE * cost.per_row / cost.per_position))
    used = cells([offers[i].prefill + 1 for i in deciding], padded)  # every session's token
    waiting = sum(offers[i].prefill + 1 for i in joining)
    spare = max(0, budget - used)
    kept = min(waiting, max(least_chunk, int(PREFILL_SHARE * spare))) if joining else 0
    drafts = max(0, spare - kept)
    pays = (functools.partial(_pays, cost, len(deciding)) if cost is not None and fitted
            else None)
    chosen = (_by_depth if padded else _by_worth)(offers, deciding, drafts, used, pays)
    depths, positions, least, passed = chosen
    # The level: the least worth verified (a session's positions of at least that worth are
    # what the planner takes first); nothing verified, just above the most worth left out.
    level = (float(least) if least < np.inf
             else float(np.nextafter(passed, np.inf)) if passed else 0.0)
    # Prompts: whole where they fit (padded: only within the pass's width, where a row
    # costs the width and pads nobody), else a chunk, first come first served (padded: no
    # chunk longer than the first, all in one forward).
    room = max(budget - positions, kept) if joining else 0
    if cap is not None:
        room = min(room, max(0, cap - positions))
    width = positions // len(deciding) if padded else 0
    out_depths: list[int | None] = [depths.get(i) for i in range(len(offers))]
    chunks = [0] * len(offers)
    longest, count = 0, 0  # padded: the chunks' forward's width and rows
    for i in joining:
        offer = offers[i]
        if not padded:
            if offer.whole <= room:
                out_depths[i] = len(offer.nodes)
                room -= offer.whole
            elif room >= min(least_chunk, offer.prefill):  # no chunk too short to pay
                chunks[i] = min(offer.prefill, room)
                room -= chunks[i]
        elif offer.whole <= width <= room:
            out_depths[i] = len(offer.nodes)
            room -= width
        else:
            size = min(offer.prefill, longest or room)
            if size < min(least_chunk, offer.prefill) or (count + 1) * max(longest, size) > room:
                continue  # too short a chunk to pay its row, or no room for another
            chunks[i], longest, count = size, max(longest, size), count + 1
            if size == offer.prefill and offer.whole - size <= width:
                out_depths[i] = len(offer.nodes)  # all in: its token and draft ride too
    return Plan(tuple(out_depths), tuple(chunks), level)


def _prompts(offers: Sequence[Offer], cap: int, padded: bool) -> Plan:
    """:func:`plan` for prompts alone (every offer a prompt that may be split) past a
    ``cap``: each whole while it fits, else a chunk of what is left, first come first
    served (``padded``: chunks no longer than the first, in one forward of rows x the
    longest)."""
    depths: list[int | None] = [len(o.nodes) for o in offers]
    chunks = [0] * len(offers)
    room, longest, count = cap, 0, 0
    for i, offer in enumerate(offers):
        if not padded and offer.whole <= room:
            room -= offer.whole
            continue
        size = min(offer.prefill, room if not padded else longest or room)
        if size <= 0 or (padded and (count + 1) * max(longest, size) > room):
            depths[i] = None  # no room: the next pass
            continue
        depths[i], chunks[i] = None, size
        if padded:
            longest, count = max(longest, size), count + 1
        else:
            room -= size
    return Plan(tuple(depths), tuple(chunks), 0.0)


def _pays(cost: PassCost, rows: int, worth: float, step: int, tokens: float,
          positions: int) -> bool:
    """Whether ``worth`` tokens for ``step`` more positions raise the tokens per second
    of a pass of ``rows`` sessions (``tokens`` so far, in ``positions``)."""
    rate = tokens / max(cost.predict(rows, positions), 1e-9)
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


def _by_depth(offers: Sequence[Offer], deciding: list[int], drafts: int, used: int,
              pays: Callable[[float, int, float, int], bool] | None
              ) -> tuple[dict[int, int], int, float, float]:
    """:func:`_by_worth` for a padded runtime: one depth for every session (its draft's
    own where shorter), as deep as each further depth fits and its positions' worth
    together pays for the row of positions it adds to every session's."""
    def width(depth: int) -> int:
        return max(offers[i].prefill + 1 + _nodes(offers[i], min(depth, len(offers[i].nodes)))
                   for i in deciding)

    rows, deepest = len(deciding), max(len(offers[i].nodes) for i in deciding)
    depth, tokens, positions = 0, float(rows), used
    least, passed = np.inf, 0.0
    while depth < deepest:
        worths = [offers[i].worth[depth] for i in deciding if len(offers[i].nodes) > depth]
        step = rows * width(depth + 1) - positions  # positions: rows x the width so far
        if step > drafts or (pays is not None and step
                             and not pays(sum(worths), step, tokens, positions)):
            passed = max(worths)
            break
        depth += 1
        least = min(least, *worths)
        drafts -= step
        positions += step
        tokens += sum(worths)
    return ({i: min(depth, len(offers[i].nodes)) for i in deciding}, positions,
            float(least), passed)


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

