"""The edge's options, parsed once: how it drafts, how it verifies, how it copes with a
failing link.

Every way of setting them ends here: command-line flags, ``config.toml`` and the
``SPECECD_EDGE_*`` environment (through :mod:`spececd.config`), and the Python API
(``Generator.load(k=..., proactive=...)``). :meth:`EdgeOptions.with_settings` turns what a
user wrote (a string, a number, a bool or the enum itself) into typed values, or raises
:class:`~spececd.errors.InputError` saying what was wrong and what to write instead.
Each default lives here, once; code inside the edge takes an :class:`EdgeOptions` and
never re-parses or re-defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

from spececd.core.sampling import Mode
from spececd.errors import InputError


class Proactive(str, enum.Enum):
    """What the edge does while the verifier works."""

    # With a server: off, on or stream, whichever is measured fastest on the link (the
    # edge client's StrategyChoosers); in-process: off (resolved by spececd.api).
    AUTO = "auto"
    OFF = "off"  # plain rounds: draft, send, wait for the verdict
    ON = "on"  # draft the next block while the verdict is in flight
    STREAM = "stream"  # the server generates; drafts stream ahead of it as hints


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
    k: int | None = None  # drafted tokens per round; None ("auto"): chosen each round
    k_max: int = 8  # the longest draft "auto" may choose; stream drafting's lookahead
    proactive: Proactive = Proactive.AUTO
    max_support: int = 64  # exact mode: the draft distribution is cut to this many tokens
    fallback: Fallback = Fallback.NONE
    reconnect: Reconnect = Reconnect()
    threshold: float = 0.0  # threshold mode (LOSSY) only, in (0, 1]; 0 otherwise
    tree_width: int = 1  # candidates per drafted position (1: chains; > 1: token trees)

    def __post_init__(self) -> None:  # options built directly get the settings' checks
        for name in ("mode", "k", "proactive", "max_support", "fallback", "threshold",
                     "tree_width"):
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
    "threshold": _threshold,
    "k": parse_k,
    "proactive": _proactive,
    "max_support": _number(int, "max-support", low=1),
    "tree_width": _number(int, "tree-width", low=1),
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
