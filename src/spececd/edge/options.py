"""The edge's options, parsed once, and what a generation runs with, resolved once.

Every way of setting them ends here: command-line flags, ``config.toml`` and the
``SPECECD_EDGE_*`` environment (through :mod:`spececd.config`), the Python API
(``Generator.load(k=..., proactive=...)``, ``Generator.stream(temperature=...)``) and the
OpenAI request body (:mod:`spececd.openai_api`). :meth:`EdgeOptions.with_settings` turns
what a user wrote (a string, a number, a bool or the enum itself) into typed values, or
raises :class:`~spececd.errors.InputError` saying what was wrong and what to write instead.

Then :func:`resolve` decides, once per generation, what it runs with: the options as they
run where this process is (:meth:`EdgeOptions.resolved`, :class:`Site`: the verifier in
this process or on a server, the draft's tokenizer the target's or another) and the
sampling parameters (:func:`sampling_params`; their defaults are
:class:`~spececd.core.params.SamplingParams`' own), in one frozen :class:`Resolved`.
What the server's welcome bounds is read from it with :meth:`EdgeOptions.draft_limit`, and
the mode each session verifies in with :meth:`EdgeOptions.session_mode`.

Each default and each rule lives here, once; code inside the edge takes these values and
never re-parses or re-defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import cast

from spececd.core.params import Mode, SamplingParams, check_token_ids
from spececd.errors import InputError

# Seconds without a reply from the verifier before the link is deemed dead (and reconnected,
# the history re-sent): how long a hung server or replica stalls generation.
ROUND_TIMEOUT = 120.0
# With a fallback to the draft alone: seconds of failed reconnection before it goes on alone.
FALLBACK_AFTER = 2.0


class Proactive(str, enum.Enum):
    """What the edge does while the verifier works."""

    # With a server: off, on or stream, whichever is measured fastest on the link (the
    # edge client's StrategyChoosers); in-process: off (EdgeOptions.resolved).
    AUTO = "auto"
    OFF = "off"  # plain rounds: draft, send, wait for the verdict
    ON = "on"  # draft the next block while the verdict is in flight
    STREAM = "stream"  # the server generates; drafts stream ahead of it as hints


class DraftKind(str, enum.Enum):
    """Where drafts come from (:mod:`spececd.edge.sources`)."""

    # Hybrid where a draft model is loaded, else prompt lookup (DraftKind.where).
    AUTO = "auto"
    MODEL = "model"  # the draft model
    LOOKUP = "lookup"  # n-gram lookup in the prompt and the text so far (no model)
    SUFFIX = "suffix"  # a suffix trie of the text and earlier generations (no model)
    HYBRID = "hybrid"  # lookup where it matches, the draft model elsewhere

    def where(self, draft_model: bool) -> DraftKind:
        """This kind where a draft model is loaded (``draft_model``) or not: ``auto`` is
        hybrid with one (lookup where it matches, the model elsewhere: about as many target
        passes as the model alone, fewer on text that repeats, for a quarter fewer draft
        steps), prompt lookup without (suffix drafting's chains are the same, at a higher
        cost a round); a kind that needs a model where none is loaded is an
        :class:`~spececd.errors.InputError`."""
        if self is DraftKind.AUTO:
            return DraftKind.HYBRID if draft_model else DraftKind.LOOKUP
        if self in (DraftKind.MODEL, DraftKind.HYBRID) and not draft_model:
            raise InputError(f"draft source {self.value} needs a draft model, and none is "
                             f"loaded here: load one (--draft-model), or draft without one "
                             f"(--draft lookup or suffix)")
        return self


class Fallback(str, enum.Enum):
    """What to do when the verifier stays unreachable."""

    NONE = "none"  # fail with CloudUnreachable
    DRAFT = "draft"  # finish with the draft model alone, marked as unverified


@dataclass(frozen=True)
class Reconnect:
    attempts: int | None = None  # reconnections tried at most (None: as the timeout allows)
    delay: float = 0.25  # seconds before the first; doubled for each next one, with jitter
    max_delay: float = 8.0
    # Seconds of failing reconnections before giving up: long enough for a verifier to
    # restart with a large model (30-120 s), or for the balancer to route elsewhere.
    timeout: float = 60.0


@dataclass(frozen=True)
class EdgeOptions:
    mode: Mode = Mode.EXACT
    draft_source: DraftKind = DraftKind.AUTO  # where drafts come from
    k: int | None = None  # drafted tokens per round; None ("auto"): chosen each round
    k_max: int = 8  # the longest draft "auto" may choose; stream drafting's lookahead
    proactive: Proactive = Proactive.AUTO
    max_support: int = 64  # exact mode: the draft distribution is cut to this many tokens
    fallback: Fallback = Fallback.NONE
    reconnect: Reconnect = Reconnect()
    threshold: float = 0.0  # threshold mode (LOSSY) only, in (0, 1]; 0 otherwise
    tree_width: int = 1  # candidates per drafted position (1: chains; > 1: token trees)
    # Suffix drafting (and the hybrid, which then looks up with it) also draws on the
    # session's earlier generations.
    # Off by default: a draft then depends on the history alone, so that a seed repeats its
    # output in exact mode (any draft is lossless; which one shapes a seed's sample).
    lookup_memory: bool = False
    # Under a constraint, draft under it too (its forced tokens cost no draft step); off,
    # the draft runs unconstrained and the verifier's mask alone keeps the output valid.
    constrained_drafting: bool = True

    def __post_init__(self) -> None:  # options built directly get the settings' checks
        for name in ("mode", "draft_source", "k", "proactive", "max_support", "fallback",
                     "threshold", "tree_width", "lookup_memory", "constrained_drafting"):
            parse_setting(name, getattr(self, name))
        parse_setting("reconnect_attempts", self.reconnect.attempts)
        parse_setting("reconnect_delay", self.reconnect.delay)
        parse_setting("reconnect_timeout", self.reconnect.timeout)
        if self.k_max < 1:
            raise InputError(f"k_max must be >= 1, got {self.k_max}")
        if (self.mode is Mode.THRESHOLD) != (self.threshold > 0):
            raise InputError("mode threshold and a threshold go together: pass --mode "
                             "threshold --threshold P (0 < P <= 1; lossy, for experiments), "
                             "or neither")
        if self.mode is Mode.THRESHOLD and self.proactive is Proactive.STREAM:
            raise InputError("stream drafting verifies by match; threshold mode verifies "
                             "drafted blocks: use --proactive off or on with it")

    def resolved(self, site: Site) -> EdgeOptions:
        """These options as they run at ``site``; resolving twice changes nothing.

        - ``proactive="auto"``: against a server, which of plain rounds, block-ahead rounds
          and stream drafting is faster on the link is measured as generation goes (the
          edge client's :class:`~spececd.core.chooser.StrategyChooser` pair), except in
          threshold mode, which does not stream: block-ahead rounds; in-process, plain
          rounds (the draft and the target share this machine's cores, and there is no
          link to hide). Every explicit setting, stream drafting included, works both
          ways: the in-process verifier runs on its own event loop, like a server.
        - across two tokenizers, exact verification (which needs the draft's distribution
          over the target's ids) is replaced by match, which needs ids only.
        - ``draft_source``: as :meth:`DraftKind.where` says for this site.
        """
        proactive, mode = self.proactive, self.mode
        draft = self.draft_source.where(site.draft_model)
        if proactive is Proactive.AUTO and site.in_process:
            proactive = Proactive.OFF
        elif proactive is Proactive.AUTO and mode is Mode.THRESHOLD:
            proactive = Proactive.ON
        if site.cross and mode is Mode.EXACT:
            mode = Mode.MATCH
        return dataclasses.replace(self, proactive=proactive, mode=mode, draft_source=draft)

    def session_mode(self, streams: bool) -> tuple[Mode, float]:
        """The mode a session verifies in, and its threshold (0 but in threshold mode):
        these options' own, but by match where the server generates (stream drafting,
        cloud-only generation), since drafts then travel without distributions."""
        mode = Mode.MATCH if streams else self.mode
        return mode, self.threshold if mode is Mode.THRESHOLD else 0.0

    def draft_limit(self, max_draft: int) -> int:
        """The most tokens a round drafts (stream drafting: its lookahead), under the
        ``max_draft`` the server's welcome allows: ``k``, or ``k_max`` with ``k="auto"``."""
        return min(self.k or self.k_max, max_draft)

    def link_reconnect(self, probe: bool = False) -> Reconnect:
        """How the link reconnects for a generation: as :attr:`reconnect` says, but with
        ``fallback="draft"`` for at most :data:`FALLBACK_AFTER` seconds (the draft goes on
        alone during an outage), and, while it does (``probe``), trying the verifier once."""
        reconnect = self.reconnect
        if self.fallback is Fallback.DRAFT:
            reconnect = dataclasses.replace(reconnect,
                                            timeout=min(reconnect.timeout, FALLBACK_AFTER))
        return dataclasses.replace(reconnect, attempts=0) if probe else reconnect

    def with_settings(self, **settings: object) -> EdgeOptions:
        """These options with ``settings`` (by the names in :data:`SETTINGS`, as a user
        wrote them) applied; a setting that is None keeps its value."""
        values = {name: parse_setting(name, value) for name, value in settings.items()
                  if value is not None}
        if values.get("mode", Mode.THRESHOLD) is not Mode.THRESHOLD \
                and "threshold" not in values:
            values["threshold"] = 0.0  # leaving threshold mode leaves its threshold
        reconnect = values.pop("reconnect", self.reconnect)
        assert isinstance(reconnect, Reconnect)
        attempts = values.pop("reconnect_attempts", reconnect.attempts)
        delay = values.pop("reconnect_delay", None)
        timeout = values.pop("reconnect_timeout", None)
        assert isinstance(attempts, int | None) and isinstance(delay, float | None)
        assert isinstance(timeout, float | None)
        reconnect = Reconnect(attempts, reconnect.delay if delay is None else delay,
                              reconnect.max_delay,
                              reconnect.timeout if timeout is None else timeout)
        return dataclasses.replace(self, reconnect=reconnect, **values)  # type: ignore[arg-type]


def parse_k(value: object) -> int | None:
    """A fixed draft length, or None for ``"auto"`` (chosen each round)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    k = _number(int, "k", low=1, hint=" or 'auto'")(value)
    assert isinstance(k, int)
    return k


def _number(kind: type[int] | type[float], what: str, low: float,
            hint: str = "") -> Callable[[object], object]:
    def parse(value: object) -> object:
        number = None
        accepted = (int, str) if kind is int else (int, float, str)  # 2.5 is no count
        if isinstance(value, accepted) and not isinstance(value, bool):
            with contextlib.suppress(ValueError):
                number = kind(value)
        if number is None or number < low:
            raise InputError(f"{what} must be a number >= {low}{hint}, got {value!r}")
        return number

    return parse


def _choice(kind: type[enum.Enum], what: str,
            allowed: tuple[enum.Enum, ...] | None = None) -> Callable[[object], object]:
    choices = allowed or tuple(kind)

    def parse(value: object) -> object:
        try:
            choice = kind(value.strip().lower() if isinstance(value, str) else value)
        except ValueError:
            choice = None
        if choice not in choices:
            names = ", ".join(str(c.value) for c in choices)
            raise InputError(f"{what} must be one of {names}, got {value!r}")
        return choice

    return parse


def _proactive(value: object) -> object:
    if isinstance(value, bool):  # the API's proactive=True / False
        return Proactive.ON if value else Proactive.OFF
    return _choice(Proactive, "proactive")(value)


def _threshold(value: object) -> object:
    number = _number(float, "threshold", low=0.0, hint=" and <= 1")(value)
    assert isinstance(number, float)
    if number > 1.0:
        raise InputError(f"threshold must be a probability in (0, 1] (0: none), got {value!r}")
    return number


def _switch(what: str) -> Callable[[object], object]:
    def parse(value: object) -> object:
        text = value.strip().lower() if isinstance(value, str) else value
        if text in (True, "true", "on", "yes", "1"):
            return True
        if text in (False, "false", "off", "no", "0"):
            return False
        raise InputError(f"{what} must be true or false, got {value!r}")

    return parse


def _reconnect(value: object) -> object:
    if not isinstance(value, Reconnect):
        raise InputError(f"reconnect must be a Reconnect(attempts, delay, max_delay, "
                         f"timeout), "
                         f"got {value!r}")
    return value


# The settings a user can write, by name: config.toml's [edge] keys, SPECECD_EDGE_<NAME>,
# --flags, and Generator.load's keywords (``reconnect`` is the API's alone).
SETTINGS: dict[str, Callable[[object], object]] = {
    "mode": _choice(Mode, "mode"),
    "draft_source": _choice(DraftKind, "draft-source"),
    "threshold": _threshold,
    "k": parse_k,
    "proactive": _proactive,
    "max_support": _number(int, "max-support", low=1),
    "tree_width": _number(int, "tree-width", low=1),
    "constrained_drafting": _switch("constrained-drafting"),
    "lookup_memory": _switch("lookup-memory"),
    "fallback": _choice(Fallback, "fallback"),
    "reconnect_attempts": lambda value: None if value is None or (
        isinstance(value, str) and value.strip().lower() == "unlimited") else _number(
        int, "reconnect-attempts", low=0, hint=" or 'unlimited'")(value),
    "reconnect_delay": _number(float, "reconnect-delay", low=0),
    "reconnect_timeout": _number(float, "reconnect-timeout", low=0),
    "reconnect": _reconnect,
}


def parse_setting(name: str, value: object) -> object:
    """The typed value of one setting; InputError if it is not one."""
    if name not in SETTINGS:
        raise TypeError(f"unknown edge option {name!r}; known: {', '.join(SETTINGS)}")
    return SETTINGS[name](value)


@dataclass(frozen=True)
class Site:
    """What this process knows that decides how options run (:meth:`EdgeOptions.resolved`)
    and what sampling settings may name (:func:`sampling_params`)."""

    in_process: bool  # the verifier runs in this process (else: on a server)
    cross: bool = False  # the draft's tokenizer is not the target's
    draft_model: bool = True  # a draft model is loaded (else only lookup drafts)
    vocab_size: int = 0  # the target's vocabulary: token ids a setting may name
    eos_token_ids: tuple[int, ...] = ()  # the stop tokens when none are given


@dataclass(frozen=True)
class Resolved:
    """What one generation runs with: the edge's options and the sampling parameters, as
    :func:`resolve` decided them, and the token ids its output is expected to be, if the
    caller said (``prediction``, OpenAI's Predicted Outputs: drafted first, where the
    output follows them). Everything downstream reads it; nothing re-defaults."""

    options: EdgeOptions
    params: SamplingParams
    prediction: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # what resolving guarantees, for values built directly
        if self.params.seed is None:
            raise ValueError("a generation runs with a concrete seed: resolve its sampling "
                             "parameters (sampling_params) or set one")
        if self.options.proactive is Proactive.AUTO and self.options.mode is Mode.THRESHOLD:
            raise ValueError("threshold mode does not stream, so auto has nothing to choose "
                             "from: resolve the options (EdgeOptions.resolved) first")

    def with_seed(self, seed: int) -> Resolved:
        """The same options, sampling with ``seed``."""
        return dataclasses.replace(self, params=dataclasses.replace(self.params, seed=seed))


# The prompt's length and healing's mask are the edge's (token_healing asks for the mask).
SAMPLING_SETTINGS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                          if f.name not in ("prompt_len", "heal_ids"))


def sampling_params(settings: Mapping[str, object], site: Site) -> SamplingParams:
    """The sampling parameters ``settings`` (by :class:`SamplingParams`' field names; a
    setting that is None or left out takes its default) ask for, checked: a fresh random
    ``seed`` when none is given, the tokenizer's end-of-sequence tokens when no
    ``stop_token_ids`` are, and ``logit_bias`` (token id -> bias, a mapping or pairs)
    naming only ids of the vocabulary."""
    unknown = set(settings) - set(SAMPLING_SETTINGS)
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {', '.join(sorted(unknown))}; known: "
                        f"{', '.join(SAMPLING_SETTINGS)}")
    values = {name: value for name, value in settings.items() if value is not None}
    stops = values.pop("stop_token_ids", site.eos_token_ids)
    given = values.pop("logit_bias", {})
    assert isinstance(stops, Iterable) and isinstance(given, Mapping | Iterable)
    stops = tuple(stops)
    check_token_ids([t for t in stops if t not in site.eos_token_ids], site.vocab_size,
                    "stop_token_ids")
    pairs = given.items() if isinstance(given, Mapping) else given
    bias = tuple(sorted((int(t), float(b)) for t, b in pairs))
    if any(token >= site.vocab_size for token, _ in bias):
        raise InputError(f"logit-bias names token ids outside the vocabulary of "
                         f"{site.vocab_size}")
    seed = cast("int | None", values.pop("seed", None))
    return SamplingParams(**values,  # type: ignore[arg-type]
                          seed=secrets.randbits(62) if seed is None else seed,
                          stop_token_ids=stops, logit_bias=bias)


def resolve(options: EdgeOptions, sampling: Mapping[str, object], site: Site,
            prompt_len: int) -> Resolved:
    """What a generation after a prompt of ``prompt_len`` tokens runs with, whichever way
    it was asked for: ``options`` as they run at ``site`` (:meth:`EdgeOptions.resolved`),
    and the sampling parameters ``sampling`` asks for (:func:`sampling_params`), at
    temperature 0 in greedy mode and with the prompt's length (the penalties count what
    follows it)."""
    options = options.resolved(site)
    params = sampling_params(sampling, site)
    temperature = 0.0 if options.mode is Mode.GREEDY else params.temperature
    return Resolved(options, dataclasses.replace(params, temperature=temperature,
                                                 prompt_len=prompt_len))
