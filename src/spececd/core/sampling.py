"""Sampling parameters, logits processing and sampling: pure NumPy, explicit RNG.

`process_logits` turns raw logits into the distribution a model samples from. First the
penalties, which depend on the tokens so far (:func:`penalize`): the repetition penalty
(transformers' ``RepetitionPenaltyLogitsProcessor``, over the prompt and the generated
tokens), the presence and frequency penalties (OpenAI's definition, as vLLM applies it:
over the generated tokens only), then ``logit_bias`` (added to the logits), then token
healing's mask (``heal_ids``: at the first generated position, the position
``prompt_len``, every other token is removed; :mod:`spececd.healing`). Then
temperature, top-k, top-p and min-p, with the semantics of transformers'
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` (ties with the k-th score are kept),
``TopPLogitsWarper`` (the smallest set whose mass exceeds ``top_p``, at least one token)
and ``MinPLogitsWarper`` (tokens below ``min_p`` times the most likely one's probability
go). Temperature 0 means greedy: a one-hot distribution on the first argmax of the
penalized logits.

The drafter's distribution is sent to the verifier as a :class:`SparseProbs` (support ids
plus probabilities). Both sides read it through :meth:`SparseProbs.normalized`, so the
drafter samples from exactly the distribution the verifier sees: that is what keeps
``exact`` verification lossless.

Randomness is never global: every draw takes a ``numpy.random.Generator``. `round_rng`
derives one from (seed, stream, position), so a round's randomness depends only on where
it is in the sequence, never on what happened before; a retried or resumed round draws
the same numbers.

A :class:`Constraint` (a JSON schema, a regex, a choice of strings, a grammar) restricts
what may be generated; this module only names and checks it. Compiling it against a
tokenizer and masking logits with it is :mod:`spececd.grammar`'s work.

This module knows nothing about models, tokenizers or the network.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from spececd.core.logprobs import RAW, check_logprobs
from spececd.errors import InputError

# The widest bias ``logit_bias`` may add to a logit (-100 in effect bans a token), and the
# widest presence or frequency penalty (OpenAI's ranges): the request schemas publish these.
LOGIT_BIAS_LIMIT = 100  # ints: the OpenAPI document shows them as written
TOP_K_LIMIT = 2**31 - 1  # a top-k past this is past every vocabulary
PENALTY_LIMIT = 2

# Streams of `round_rng`: the verifier's and the drafter's randomness must be independent.
VERIFIER_STREAM = 0
DRAFTER_STREAM = 1


class Mode(str, enum.Enum):
    """How the verifier decides which drafted tokens to keep (ARCHITECTURE §3)."""

    EXACT = "exact"  # Leviathan et al. rejection sampling; needs draft_probs
    MATCH = "match"  # verifier samples its own token, keeps drafts while equal
    GREEDY = "greedy"  # temperature 0: keep drafts while they equal the target argmax
    THRESHOLD = "threshold"  # LOSSY: keep drafts the target gives at least a set probability

    @property
    def lossy(self) -> bool:
        """Whether the output may differ in distribution from the target alone."""
        return self is Mode.THRESHOLD


CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# The largest spec a constraint may carry (a schema, a grammar): bigger ones are refused
# before anything compiles them.
MAX_CONSTRAINT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Constraint:
    """What the output must match, applied on both sides like the other sampling settings
    (the verifier is the authority). ``kind`` and ``spec``:

    - ``json_object``: any JSON object (``spec`` empty);
    - ``json_schema``: ``spec`` the schema's JSON text; ``strict`` False lets objects carry
      properties the schema does not name (OpenAI's ``strict: false``; xgrammar's
      ``strict_mode``), True allows only the named ones;
    - ``regex``: ``spec`` the regular expression the whole output matches;
    - ``choice``: ``spec`` a JSON list of strings, the output being one of them;
    - ``grammar``: ``spec`` an EBNF grammar (GBNF, as llama.cpp writes them) with a
      ``root`` rule, or a Lark grammar (xgrammar takes both).

    The end-of-sequence token is allowed only where the output is complete.
    """

    kind: str
    spec: str = ""
    strict: bool = True  # json_schema only

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InputError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InputError(f"a {self.kind} constraint's spec must be a string")
        if len(self.spec.encode()) > MAX_CONSTRAINT_BYTES:
            raise InputError(f"the {self.kind} constraint is {len(self.spec.encode())} bytes, "
                             f"over the limit of {MAX_CONSTRAINT_BYTES}")
        if self.kind == "json_object":
            if self.spec:
                raise InputError("a json_object constraint takes no spec (use json_schema "
                                 "for a schema)")
            return
        if not self.spec:
            raise InputError(f"a {self.kind} constraint needs a spec (the "
                             f"{_SPEC_NAMES[self.kind]})")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InputError(f"invalid json_schema constraint: the schema is not JSON "
                                 f"({exc})") from None
            if not isinstance(schema, dict | bool):
                raise InputError(f"invalid json_schema constraint: a schema is a JSON object, "
                                 f"got {type(schema).__name__}")
        elif self.kind == "choice":
            self.choices()

    def choices(self) -> list[str]:
        """A ``choice`` constraint's strings (raises :class:`InputError` when its spec is
        not a non-empty JSON list of strings)."""
        try:
            choices = json.loads(self.spec)
        except ValueError:
            choices = None
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) for c in choices)):
            raise InputError(f"invalid choice constraint: the spec must be a non-empty JSON "
                             f"list of strings, got {self.spec[:80]!r}")
        return choices

    @classmethod
    def of_choices(cls, choices: Sequence[str]) -> Constraint:
        return cls("choice", json.dumps(list(choices)))


_SPEC_NAMES = {"json_schema": "schema's JSON text", "regex": "regular expression",
               "choice": "JSON list of strings", "grammar": "grammar's text"}


@dataclass(frozen=True)
class SamplingParams:
    """Per-session generation settings, applied identically by drafter and verifier.

    ``top_k = 0`` and ``top_p = 1.0`` disable those filters; ``temperature = 0`` is greedy.
    ``seed = None`` lets the caller pick a fresh random seed.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    prompt_len: int = 0  # the context's first tokens that are the prompt (set by the edge)
    constraint: Constraint | None = None  # what the output after the prompt must match
    # The target's log-probabilities (spececd.core.logprobs), reported, not sampled from:
    # of each generated token with this many alternatives (None: not asked), of the prompt's
    # tokens too (echo), and which distribution (vLLM's logprobs_mode).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = RAW
    # Token healing (spececd.healing): the only tokens the first generated position (the
    # one after the prompt's ``prompt_len`` tokens) may take; empty: any.
    heal_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(
                f"temperature must be a number >= 0 (0 means greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise InputError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if self.top_k > TOP_K_LIMIT:  # past any vocabulary, and past what the wire carries
            raise InputError(f"top-k must be at most {TOP_K_LIMIT} (0 disables it), got "
                             f"{self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top-p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.max_tokens < 1:
            raise InputError(f"max-tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InputError(f"seed must be in [0, 2**63), got {self.seed}")
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InputError(f"repetition-penalty must be a number > 0 (1 disables it), got "
                             f"{self.repetition_penalty}")
        for name, value in (("presence-penalty", self.presence_penalty),
                            ("frequency-penalty", self.frequency_penalty)):
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise InputError(f"{name} must be in [{-PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 "
                                 f"disables it), got {value}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min-p must be in [0, 1] (0 disables it), got {self.min_p}")
        for token, bias in self.logit_bias:
            if token < 0 or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InputError(f"logit-bias takes token ids >= 0 and biases in "
                                 f"[{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                                 f"got {token}: {bias}")
        if self.prompt_len < 0:
            raise InputError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InputError(f"constraint must be a spececd Constraint, got "
                             f"{type(self.constraint).__name__}")
        check_logprobs(self.logprobs, self.logprobs_mode)
        check_logprobs(self.prompt_logprobs, self.logprobs_mode, "prompt_logprobs")
        if any(token < 0 for token in self.heal_ids):
            raise InputError("heal_ids takes token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the distribution depends on the tokens so far or on the position (see
        :func:`penalize`)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias)
                or bool(self.heal_ids))


def round_rng(seed: int, stream: int, position: int) -> np.random.Generator:
    """The generator for one round: a pure function of seed, stream and position."""
    return np.random.default_rng([seed, stream, position])


def _softmax(scores: np.ndarray) -> np.ndarray:  # [n, vocab] -> [n, vocab]
    shifted = scores - scores.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def penalize(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
             start: int) -> np.ndarray:
    """The penalties and biases of ``params`` applied to ``logits`` ``[n, vocab]``, where
    row ``i`` is the distribution after ``history[:start + i]`` (a block's rows follow
    its drafted tokens), and token healing's mask at row ``params.prompt_len - start``.
    Returns float64 logits (the input when nothing applies)."""
    if not params.penalized:
        return logits
    scores = logits.astype(np.float64)
    n, vocab = scores.shape
    if start + n - 1 > len(history):
        raise ValueError(f"{n} rows after {start} tokens need {start + n - 1} tokens of "
                         f"history, got {len(history)}")
    tokens = np.asarray(history[:start + n - 1], dtype=np.int64)
    first_generated = min(params.prompt_len, start)
    seen = np.bincount(tokens[:start], minlength=vocab)[:vocab] > 0  # prompt and output
    counts = np.bincount(tokens[first_generated:start], minlength=vocab)[:vocab]  # output
    bias = np.zeros(vocab)
    for token, value in params.logit_bias:
        if token < vocab:
            bias[token] += value
    for i in range(n):
        if i:  # the previous row's token is history now
            token = int(tokens[start + i - 1])
            seen[token] = True
            if start + i - 1 >= params.prompt_len:
                counts[token] += 1
        row = scores[i]
        if params.repetition_penalty != 1.0:
            picked = row[seen]
            row[seen] = np.where(picked > 0, picked / params.repetition_penalty,
                                 picked * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        row += bias
    healed = params.prompt_len - start  # the row of the first generated position
    if params.heal_ids and 0 <= healed < n:
        allowed = np.asarray([t for t in params.heal_ids if t < vocab], dtype=np.int64)
        kept = scores[healed, allowed]
        scores[healed] = -np.inf
        scores[healed, allowed] = kept
    return scores


def process_logits(logits: np.ndarray, params: SamplingParams,
                   history: Sequence[int] | None = None, start: int = 0) -> np.ndarray:
    """Logits ``[n, vocab]`` to float64 probabilities ``[n, vocab]`` per `params`; row
    ``i`` follows ``history[:start + i]``, which the penalties need (:func:`penalize`)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    if params.greedy:
        n, vocab = logits.shape
        probs = np.zeros((n, vocab), dtype=np.float64)
        probs[np.arange(n), greedy_tokens(logits, params, history, start)] = 1.0
        return probs
    if params.penalized:
        if history is None:
            raise ValueError("penalties and biases need the token history")
        logits = penalize(logits, params, history, start)
    n, vocab = logits.shape
    scores = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < vocab:
        kth = np.partition(scores, vocab - params.top_k, axis=-1)[:, vocab - params.top_k]
        scores[scores < kth[:, None]] = -np.inf
    if params.top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending
        cumulative = np.cumsum(_softmax(np.take_along_axis(scores, order, axis=-1)), axis=-1)
        remove = cumulative <= 1.0 - params.top_p
        remove[:, -1] = False  # always keep the most likely token
        np.put_along_axis(
            scores, order, np.where(remove, -np.inf, np.take_along_axis(scores, order, -1)), -1
        )
    probs = _softmax(scores)
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(axis=-1, keepdims=True), 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def greedy_tokens(logits: np.ndarray, params: SamplingParams,
                  history: Sequence[int] | None = None, start: int = 0) -> np.ndarray:
    """The token each row ``[n, vocab]`` of ``logits`` picks at temperature 0 (after the
    penalties and biases of ``params``, as :func:`process_logits`): ``[n]`` integers, the
    point masses :func:`process_logits` returns as one-hot rows."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    if params.penalized:
        if history is None:
            raise ValueError("penalties and biases need the token history")
        logits = penalize(logits, params, history, start)
    return logits.argmax(axis=-1)  # type: ignore[no-any-return]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from ``probs`` ``[vocab]`` (non-negative, positive sum) by inverse CDF."""
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    # Rounding can push the draw past the end; land on the last token with mass.
    return min(index, int(np.flatnonzero(probs)[-1]))


@dataclass(frozen=True)
class SparseProbs:
    """A draft distribution over a support: ``ids`` ``[m]`` int64, ``probs`` ``[m]`` float32.

    The distribution is ``probs / probs.sum()`` (see :meth:`normalized`); ids are unique.
    """

    ids: np.ndarray
    probs: np.ndarray

    def normalized(self) -> np.ndarray:  # [m] float64
        p = self.probs.astype(np.float64)
        return p / p.sum()  # type: ignore[no-any-return]

    def prob_of(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.normalized()[hit[0]]) if hit.size else 0.0

    def dense(self, vocab: int) -> np.ndarray:  # [vocab] float64
        out = np.zeros(vocab, dtype=np.float64)
        out[self.ids] = self.normalized()
        return out

    @classmethod
    def from_dense(cls, probs: np.ndarray, max_support: int = 0) -> SparseProbs:
        """The non-zero part of ``probs`` ``[vocab]``, cut to the ``max_support`` most
        likely tokens when ``max_support > 0`` (the drafter then samples from the cut)."""
        ids = np.flatnonzero(probs)
        if 0 < max_support < ids.size:
            ids = ids[np.argpartition(probs[ids], ids.size - max_support)[-max_support:]]
            ids.sort()
        kept = probs[ids]
        return cls(ids=ids.astype(np.int64), probs=(kept / kept.sum()).astype(np.float32))


def draft_distribution(logits: np.ndarray, params: SamplingParams, max_support: int,
                       history: Sequence[int]) -> SparseProbs:
    """The sparse distribution a drafter samples from, for the ``logits`` ``[vocab]`` of
    the position after ``history``."""
    return SparseProbs.from_dense(
        process_logits(logits[None, :], params, history, len(history))[0], max_support)


def sample_sparse(dist: SparseProbs, rng: np.random.Generator) -> int:
    return int(dist.ids[sample(dist.normalized(), rng)])


def check_token_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    """Raise :class:`InputError` when any id falls outside ``[0, vocab)``."""
    bad = [t for t in ids if not (0 <= t < vocab)]
    if bad:
        raise InputError(
            f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        )
