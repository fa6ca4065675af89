"""Drafts that need no model: they look the continuation up in text already seen.

Much of what people generate copies text they already have (code edits, answers that quote
their sources, JSON that re-emits its input, an agent repeating a tool's output), and
small models repeat themselves. Such text is drafted for free: where the last few tokens
occurred before, propose what followed them there.

- :class:`NgramLookup` (prompt lookup, as transformers' ``prompt_lookup_num_tokens`` and
  vLLM's ``ngram`` method): the longest suffix of the history, ``min_ngram`` to
  ``max_ngram`` tokens, found at its most recent earlier place in the history (prompt and
  generation), proposes the tokens that followed it. A chain.
- :class:`SuffixDraft` (suffix drafting, as SuffixDecoding): a :class:`SuffixTrie` of every
  stretch of up to ``depth`` tokens of the history, and, with ``memory``, of this source's
  earlier generations, counting how often each continuation followed. The longest suffix
  of the history found there proposes its most frequent continuation as the chain, and
  other continuations become siblings where the round's tree shape finds them worth their
  place (their share of the counts standing for the draft's probability): a token tree.

Both meet the edge's :class:`~spececd.edge.drafter.DraftSource` contract. Their drafts
are deterministic functions of the history, so in ``exact`` mode each drafted token is
reported with a one-hot distribution: the verifier's rejection rule then accepts it with
the target's probability and draws a correction from the rest, which is lossless with no
special case in :func:`~spececd.core.verify.verify`. They read nothing of the sampling
parameters: penalties, biases, healing and constraints are the verifier's to apply, and a
draft they rule out is rejected, never emitted. Where nothing matches they propose
nothing, and the round costs what the verifier's own token costs.

Each source remembers which positions of the history it proposed
(:meth:`looked_up_among`), so the output can say which accepted tokens were looked up.
Pure Python and numpy: no torch, no model.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import TreeShape
from spececd.core.sampling import SparseProbs
from spececd.core.tokens import common_prefix
from spececd.edge.drafter import Marks, Tree

MAX_NGRAM = 4  # the longest suffix prompt lookup matches
MIN_NGRAM = 2  # the shortest: one token matches too often to be worth a verified position
TRIE_DEPTH = 24  # suffix drafting: the longest stretch the trie indexes
MAX_MATCH = 12  # ... and the longest suffix it matches, leaving room to continue
MIN_MATCH = 2
MEMORY_TOKENS = 1 << 16  # earlier generations' tokens a suffix draft keeps at most


def one_hot(token: int) -> SparseProbs:
    """The distribution a deterministic draft of ``token`` was drawn from."""
    return SparseProbs(np.array([token], dtype=np.int64), np.array([1.0], dtype=np.float32))


def reported(tokens: Sequence[int], mode: Mode, params: SamplingParams
             ) -> tuple[SparseProbs, ...] | None:
    """What a deterministic draft reports of ``tokens``: one-hot distributions where the
    verifier needs distributions (exact mode, sampling), else nothing."""
    if mode is Mode.EXACT and not params.greedy:
        return tuple(one_hot(t) for t in tokens)
    return None


class Proposals(Marks):
    """The positions of the history a source looked up (:class:`~spececd.edge.drafter.
    Marks`), and how many tokens it has proposed so far."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def record(self, history: Sequence[int], tokens: Sequence[int],
               looked: int | None = None) -> None:
        """A draft of ``tokens`` after ``history``, whose first ``looked`` (default: all)
        were looked up."""
        self.keep(history)
        start, looked = len(history), len(tokens) if looked is None else looked
        self.at.update(range(start, start + looked))
        self.lineage = [*history, *tokens]
        self.count += looked


class Lookup(abc.ABC):
    """A draft source that needs no model: what it proposes (:meth:`propose`, a tree or a
    chain after the history) as the edge's :class:`~spececd.edge.drafter.DraftSource`,
    reported one-hot in exact mode. ``match_len`` after a call: the length of the suffix
    of the history it matched (0: none)."""

    forced = 0  # no constraint forces anything here

    def __init__(self) -> None:
        self.match_len = 0
        self._proposals = Proposals()

    @abc.abstractmethod
    def propose(self, history: Sequence[int], k: int, shape: TreeShape | None = None,
                prompt_len: int = 0) -> Tree:
        """A chain of up to ``k`` tokens after ``history``, branched as ``shape`` says
        where the source can (None: a chain); ``prompt_len``: where the generation began.
        Sets :attr:`match_len`."""

    @property
    def looked_up(self) -> int:
        """Tokens proposed so far."""
        return self._proposals.count

    def forced_among(self, history: Sequence[int], tokens: Sequence[int]
                     ) -> tuple[int, ...]:
        return ()

    def looked_up_among(self, history: Sequence[int], tokens: Sequence[int]
                        ) -> tuple[int, ...]:
        """The indices of ``tokens`` (emitted after ``history``) this source proposed."""
        return self._proposals.among(history, tokens)

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        """Up to ``k`` looked-up tokens after ``history`` (none where nothing matches),
        reported one-hot in exact mode."""
        tokens = self.propose(history, k, None, params.prompt_len).tokens
        self._proposals.record(history, tokens)
        return tokens, reported(tokens, mode, params)

    def tree(self, history: Sequence[int], k: int, shape: TreeShape, mode: Mode,
             params: SamplingParams, seed: int, max_support: int) -> Tree:
        return self._proposed(history, k, shape, mode, params)

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        """What :meth:`tree` proposes (no model here), None where nothing matches."""
        tree = self._proposed(history, k, shape, mode, params)
        return tree if tree.tokens else None

    def _proposed(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
                  params: SamplingParams) -> Tree:
        tree = self.propose(history, k, shape, params.prompt_len)
        self._proposals.record(history, tree.trunk().tokens)
        return Tree(tree.tokens, tree.parents, reported(tree.tokens, mode, params), tree.chain)


class NgramLookup(Lookup):
    """Prompt lookup (module docstring): chains only, from the most recent match of the
    longest suffix."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        super().__init__()
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history: Sequence[int], k: int, shape: TreeShape | None = None,
                prompt_len: int = 0) -> Tree:
        """A chain of up to ``k`` tokens that followed the longest matching suffix of
        ``history``, continued through the text it proposes where that runs out (a
        repeating pattern goes on repeating): one match proposes one continuation."""
        text = np.asarray(history, dtype=np.int64)
        out: list[int] = []
        self.match_len = 0
        while len(out) < k:
            found = _match(text, self.min_ngram, self.max_ngram)
            if found is None:
                break
            start, n = found
            if not out:
                self.match_len = n
            more = text[start:start + k - len(out)]
            out.extend(int(t) for t in more)
            text = np.concatenate([text, more])
        return Tree.of_chain(tuple(out), None)


def _match(text: np.ndarray, min_n: int, max_n: int) -> tuple[int, int] | None:
    """Where the continuation of the longest suffix of ``text`` ``[L]`` (``min_n`` to
    ``max_n`` tokens) starts at its most recent earlier occurrence, and the suffix's
    length; None when no suffix of ``min_n`` tokens occurs earlier."""
    size = text.size
    if size <= min_n:
        return None
    # Candidate ends: earlier places of the last token with a token after them.
    ends = np.flatnonzero(text[:size - 1] == text[size - 1])
    if ends.size == 0:
        return None
    length = np.ones(ends.size, dtype=np.int64)  # how far each candidate matches backwards
    alive = np.ones(ends.size, dtype=bool)
    for d in range(1, min(max_n, size - 1)):
        alive &= ends - d >= 0
        alive[alive] &= text[ends[alive] - d] == text[size - 1 - d]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return None
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
    return end + 1, best


class _Node:
    __slots__ = ("children", "count", "parent", "token")

    def __init__(self, parent: _Node | None, token: int) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.parent, self.token = parent, token


class SuffixTrie:
    """Every stretch of up to ``depth`` tokens of a text, with how often it occurs: the
    node reached by a stretch has the tokens that followed it as children, counted.
    :meth:`append` and :meth:`pop` add or remove the text's last token in ``O(depth)``, so
    the trie follows a history that grows and rolls back."""

    def __init__(self, depth: int = TRIE_DEPTH) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.root = _Node(None, -1)
        self.tokens: list[int] = []
        # For each position, the nodes its token was counted in (the stretches ending
        # there, shortest first): what popping it un-counts, and, but the deepest, where
        # the next token's stretches continue.
        self._ends: list[list[_Node]] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """Add ``token`` to the end of the text, counting the stretches it ends."""
        heads = [self.root, *(self._ends[-1][:self.depth - 1] if self._ends else [])]
        ends = []
        for node in heads:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(node, token)
            child.count += 1
            ends.append(child)
        self.tokens.append(token)
        self._ends.append(ends)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append each of ``tokens`` in order."""
        for token in tokens:
            self.append(token)

    def pop(self) -> None:
        """Remove the text's last token, and the stretches it ended."""
        for node in self._ends.pop():
            node.count -= 1
            if node.count == 0:
                assert node.parent is not None
                del node.parent.children[node.token]
        self.tokens.pop()

    def sync(self, history: Sequence[int]) -> int:
        """Make the indexed text ``history``: pop what it no longer holds, append the rest.
        Returns how many tokens were kept."""
        kept = common_prefix(self.tokens, history)
        while len(self.tokens) > kept:
            self.pop()
        self.extend(history[kept:])
        return kept

    def find(self, context: Sequence[int], max_len: int, min_len: int
             ) -> tuple[_Node, int] | None:
        """The node of the longest suffix of ``context`` (``min_len`` to ``max_len``
        tokens) that occurs here with a continuation, and its length; None if none does."""
        for n in range(min(max_len, len(context), self.depth - 1), min_len - 1, -1):
            node: _Node | None = self.root
            for token in context[len(context) - n:]:
                assert node is not None
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and _top(node):
                return node, n
        return None


def _top(node: _Node) -> list[_Node]:
    """``node``'s continuations, most frequent first (ties: the smaller token, so that a
    draft is a function of the text alone); a generation's end in memory is none."""
    return sorted((c for c in node.children.values() if c.token >= 0),
                  key=lambda c: (-c.count, c.token))


class SuffixDraft(Lookup):
    """Suffix drafting (module docstring): a chain along the most frequent continuation,
    and siblings where the round's tree shape finds them worth it. ``memory``: also draw on
    this source's earlier generations (up to :data:`MEMORY_TOKENS` of them; a generation
    counts as ended when a later call's history leaves its prompt). With memory, what is
    drafted depends on more than the history, so in exact mode a seed's sample does too
    (the distribution never does)."""

    def __init__(self, depth: int = TRIE_DEPTH, max_match: int = MAX_MATCH,
                 min_match: int = MIN_MATCH, memory: bool = False) -> None:
        if not 1 <= min_match <= max_match < depth:
            raise ValueError(f"need 1 <= min_match <= max_match < depth, got {min_match}, "
                             f"{max_match}, {depth}")
        super().__init__()
        self.max_match, self.min_match = max_match, min_match
        self.live = SuffixTrie(depth)  # the history: the prompt and the generation so far
        self.memory = SuffixTrie(depth) if memory else None  # earlier generations
        self._prompt_len = 0

    def _sync(self, history: Sequence[int], prompt_len: int) -> None:
        """Index ``history``; keep the generation it replaces in memory when it is another
        generation (it leaves the indexed prompt)."""
        live = self.live
        kept = common_prefix(live.tokens, history)
        if self.memory is not None and kept <= self._prompt_len < len(live):
            if len(self.memory) + len(live) - self._prompt_len > MEMORY_TOKENS:
                self.memory = SuffixTrie(live.depth)  # full: start again
            # Separate generations with a token no text holds, so no stretch spans two.
            self.memory.extend([*live.tokens[self._prompt_len:], -1])
        live.sync(history)
        self._prompt_len = prompt_len

    def _find(self, context: Sequence[int]) -> _Node | None:
        found = self.live.find(context, self.max_match, self.min_match)
        if self.memory is not None:
            earlier = self.memory.find(context, self.max_match, self.min_match)
            if earlier is not None and (found is None or earlier[1] > found[1]):
                found = earlier
        return found[0] if found is not None else None

    def propose(self, history: Sequence[int], k: int, shape: TreeShape | None = None,
                prompt_len: int = 0) -> Tree:
        """A tree after ``history``: the chain of up to ``k`` most frequent continuations
        (matched again from the drafted text where the trie's depth runs out), with the
        siblings ``shape`` pays for (None: a chain). Sets :attr:`match_len`."""
        self._sync(history, prompt_len)
        context = list(history)
        tokens: list[int] = []
        parents: list[int] = []
        chain: list[int] = []
        self.match_len = 0
        node = self._find(context)
        if node is not None:
            self.match_len = _depth(node)
        while node is not None and len(chain) < k:
            children = _top(node)
            total = sum(child.count for child in children)
            best, parent = children[0], (chain[-1] if chain else -1)
            chain.append(len(tokens))
            tokens.append(best.token)
            parents.append(parent)
            if shape is not None:  # siblings by their share of the counts
                i = len(chain) - 1
                least = shape.floor / shape.reach[i] if i < len(shape.reach) and \
                    shape.reach[i] > 0 else float("inf")
                room = shape.budget - len(tokens) - (k - len(chain))
                for child in children[1:min(shape.width, room + 1)]:
                    if child.count / total < least:
                        break
                    tokens.append(child.token)
                    parents.append(parent)
            context.append(best.token)
            node = best if _top(best) else self._find(context)
        return Tree(tuple(tokens), tuple(parents), None, tuple(chain))


def _depth(node: _Node) -> int:
    n = 0
    while node.parent is not None:
        node, n = node.parent, n + 1
    return n


PREDICTION_MAX_NGRAM = 8  # the longest suffix of the output a prediction re-anchors on
PREDICTION_SLACK = 2  # prediction tokens an edit of a token or two may skip, picked up again


def _credit(hits: int, frontier: int, place: int, count: int) -> tuple[int, int]:
    """Credit the prediction's ``count`` tokens before ``place`` as appearing in the output,
    those past ``frontier`` only (each once): the hits and the frontier after."""
    return hits + max(0, place - max(frontier, place - count)), max(frontier, place)


class Alignment:
    """Where an output stands in a ``prediction`` of it (OpenAI's Predicted Outputs), as a
    diff would align the two: the output follows the prediction token by token; where it
    leaves it (an edit), the alignment picks it up again where the last few output tokens
    (``min_ngram`` to ``max_ngram``) occur in the prediction, the longest such suffix, at
    its nearest place from where the output left (forward first: edits move on through the
    text), or, within a token or two of the divergence, where the output's token is one of
    the next :data:`PREDICTION_SLACK` + 1 prediction tokens (a token replaced, inserted or
    deleted). :meth:`sync` follows an output that grows and rolls back, in time linear in
    what changed; the alignment of an output is a function of the output alone."""

    def __init__(self, prediction: Sequence[int], max_ngram: int = PREDICTION_MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.output: list[int] = []
        # After output[:i]: (where the output continues in the prediction, -1 when it left
        # it; where it last stood there; output tokens that followed it since it was last
        # picked up, the suffix that picked it up included, or tokens since it left;
        # prediction tokens credited as appearing in the output; the prediction's place
        # past the last one credited: each is credited once, in order, as a diff would).
        self._states: list[tuple[int, int, int, int, int]] = [(0, 0, 0, 0, 0)]

    def sync(self, output: Sequence[int]) -> None:
        """Align ``output`` (the generated tokens), keeping what it shares with the last."""
        kept = common_prefix(self.output, output)
        del self.output[kept:], self._states[kept + 1:]
        for token in output[kept:]:
            self.output.append(token)
            self._states.append(self._step(self._states[-1], token))

    @property
    def at(self) -> int:
        """Where the output continues in the prediction (-1: it left the prediction and
        has not come back)."""
        return self._states[-1][0]

    @property
    def run(self) -> int:
        """Output tokens that followed the prediction since it was last picked up, those
        that picked it up included (0 when it left it)."""
        at, _, run, _, _ = self._states[-1]
        return run if at >= 0 else 0

    @property
    def hits(self) -> int:
        """Prediction tokens that appeared in the output, each counted once and in the
        prediction's order, as a diff counts them (an output that goes back and follows
        a part of the prediction again is not credited again)."""
        return self._states[-1][3]

    def _step(self, state: tuple[int, int, int, int, int], token: int
              ) -> tuple[int, int, int, int, int]:
        at, last, run, hits, frontier = state
        prediction = self.prediction
        if 0 <= at < prediction.size and prediction[at] == token:
            return at + 1, at + 1, run + 1, *_credit(hits, frontier, at + 1, 1)
        since = 1 if at >= 0 else run + 1  # output tokens since it left the prediction
        found = self._anchor(last)
        if found is not None:  # the suffix's tokens since it left were the prediction's
            place, length = found
            return place, place, length, *_credit(hits, frontier, place, min(length, since))
        if since <= PREDICTION_SLACK:
            near = np.flatnonzero(prediction[last:last + PREDICTION_SLACK + 1] == token)
            if near.size:
                place = last + int(near[0]) + 1
                return place, place, 1, *_credit(hits, frontier, place, 1)
        return -1, last, since, hits, frontier

    def _anchor(self, last: int) -> tuple[int, int] | None:
        """Where the output continues in the prediction by the longest suffix of it found
        there (``min_ngram`` tokens at least), at its nearest place from ``last``, and the
        suffix's length; None where no such suffix occurs."""
        text, prediction = self.output, self.prediction
        ends = np.flatnonzero(prediction == text[-1])
        if ends.size == 0 or len(text) < self.min_ngram:
            return None
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for d in range(1, min(self.max_ngram, len(text))):
            alive &= ends - d >= 0
            alive[alive] &= prediction[ends[alive] - d] == text[-1 - d]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_ngram:
            return None
        places = ends[length == best] + 1  # where each continues
        ahead = places[places >= last]
        return int(ahead[0]) if ahead.size else int(places[-1]), best


class PredictionLookup(Lookup):
    """Lookup over a prediction of the output (OpenAI's Predicted Outputs: the text the
    caller expects, such as the file an edit rewrites): the prediction's tokens from where
    the output stands in it (:class:`Alignment`), none where the output has left it and not
    come back, or has reached its end. Chains only."""

    def __init__(self, prediction: Sequence[int]) -> None:
        super().__init__()
        self.alignment = Alignment(prediction)

    def propose(self, history: Sequence[int], k: int, shape: TreeShape | None = None,
                prompt_len: int = 0) -> Tree:
        """Up to ``k`` tokens of the prediction after the output (``history`` past
        ``prompt_len``), aligned with it. :attr:`match_len`: the output tokens that
        followed the prediction since it was last picked up (:attr:`Alignment.run`)."""
        alignment = self.alignment
        alignment.sync(history[prompt_len:])
        at = alignment.at
        self.match_len = alignment.run
        tokens = () if at < 0 else tuple(int(t) for t in alignment.prediction[at:at + k])
        return Tree.of_chain(tokens, None)
