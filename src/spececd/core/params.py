"""The sampling records: what a session asks for, checked once when it is made.

:class:`SamplingParams` (the sampling defaults' only home), :class:`Constraint` (what the
output must match), :class:`Mode` (how the verifier keeps drafted tokens) and the limits
the request schemas publish. Each record checks its values in ``__post_init__`` and raises
:class:`~spececd.errors.InputError` with a message a user can act on; so a record that
exists is valid, and the code that reads it (:mod:`spececd.core.sampling`'s numerics,
:mod:`spececd.core.logprobs`, the protocol, both sides) checks nothing again.

This module holds values and their checks only: no arrays are processed here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from spececd.errors import InputError

# The widest bias ``logit_bias`` may add to a logit (-100 in effect bans a token), and the
# widest presence or frequency penalty (OpenAI's ranges): the request schemas publish these.
LOGIT_BIAS_LIMIT = 100  # ints: the OpenAPI document shows them as written
TOP_K_LIMIT = 2**31 - 1  # a top-k past this is past every vocabulary
PENALTY_LIMIT = 2

RAW = "raw_logprobs"
PROCESSED = "processed_logprobs"
LOGPROBS_MODES = (RAW, PROCESSED)
MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat limit, vLLM's default)


def check_logprobs(top: int | None, mode: str, what: str = "logprobs") -> None:
    """Raise :class:`InputError` unless ``top`` (None: not asked) is in ``[0, 20]`` and
    ``mode`` is one :mod:`spececd.core.logprobs` computes."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InputError(f"{what} takes 0 to {MAX_TOP_LOGPROBS} alternatives per token "
                         f"(0: the chosen token's alone), got {top}")
    if mode not in LOGPROBS_MODES:
        raise InputError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                         f"{mode!r} (vLLM's raw_logits and processed_logits are not offered)")


class Mode(str, enum.Enum):
    """How the verifier decides which drafted tokens to keep (a new one: docs/how-it-works.md,
    "Where a change belongs")."""

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
        """A ``choice`` constraint: the output is one of ``choices``."""
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
        """Whether sampling is greedy (temperature 0)."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the distribution depends on the tokens so far or on the position (see
        :func:`penalize`)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias)
                or bool(self.heal_ids))


def check_token_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    """Raise :class:`InputError` when any id falls outside ``[0, vocab)``."""
    bad = [t for t in ids if not (0 <= t < vocab)]
    if bad:
        raise InputError(
            f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        )
