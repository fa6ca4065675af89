"""Configuration's one home: typed settings for the server and the edge.

Each value comes from, in increasing order of precedence:

1. the defaults below, each kept where it belongs: the server's limits in
   :class:`~spececd.protocol.cloud_session.Limits`,
   :class:`~spececd.cloud.service.ServicePolicy` and
   :class:`~spececd.cloud.runner.RunnerConfig` (which :meth:`ServerConfig.limits`,
   :meth:`ServerConfig.policy` and :meth:`ServerConfig.runner` build), the edge's
   sampling settings in :class:`~spececd.core.params.SamplingParams`, its options
   (``mode``, ``k``, ``proactive``, ...) in :class:`~spececd.edge.options.EdgeOptions`;
2. ``config.toml`` (``--config FILE``; sections ``[server]`` and ``[edge]``, and
   ``[devices]``: ``edge_device`` and ``cloud_device`` are the edge's and the server's
   ``device``, ``[devices.npu] enabled`` is both sides' ``npu``);
3. environment variables ``SPECECD_SERVER_<NAME>`` / ``SPECECD_EDGE_<NAME>`` (upper case,
   e.g. ``SPECECD_SERVER_PORT=9000``), and ``SPECECD_AUTH_TOKEN`` for the bearer token;
4. command-line flags.

``config.example.toml`` in the repository lists every setting.

Values are converted and checked as they are read, and an error names where the bad value
came from. The edge's options are parsed here, once, into the :class:`EdgeOptions` that
everything inside the edge takes; its sampling settings reach a generation by their
:class:`SamplingParams` names (:meth:`EdgeConfig.sampling`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from spececd.cloud.runner import RunnerConfig
from spececd.cloud.service import ServicePolicy
from spececd.core.params import Constraint, SamplingParams
from spececd.edge.options import ROUND_TIMEOUT, SAMPLING_SETTINGS, EdgeOptions
from spececd.edge.options import SETTINGS as OPTION_SETTINGS
from spececd.errors import InputError
from spececd.protocol.cloud_session import Limits
from spececd.transports.registry import REQUEST_TIMEOUT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]


# Where the defaults of the settings below live (the sections only name them).
_LIMITS, _POLICY, _RUNNER, _SAMPLING = Limits(), ServicePolicy(), RunnerConfig(), SamplingParams()


@dataclass(frozen=True)
class ServerConfig:
    target_model: str = ""
    engine: str = "builtin"  # or "vllm": the target runs in vLLM's engine
    tensor_parallel_size: int = _RUNNER.tensor_parallel_size  # vLLM only
    engine_args: str = _RUNNER.engine_args  # vLLM only: a JSON object of engine arguments
    host: str = "127.0.0.1"
    port: int = 8765  # WebSocket; -1: none
    grpc_port: int = -1  # -1: no gRPC listener; 0: any free port
    http_port: int = -1  # -1: no HTTP listener; 0: any free port
    device: str = _RUNNER.device
    npu: bool = _RUNNER.npu  # whether device "npu" may use an NPU (else: the cpu, a notice)
    dtype: str = _RUNNER.dtype
    threads: int = _RUNNER.threads
    static: str = _RUNNER.static  # the built-in runner's fixed shapes (graphs): auto, on, off
    max_sessions: int = _POLICY.max_sessions
    max_context: int = _LIMITS.max_context
    max_draft: int = _LIMITS.max_draft
    pass_width: int = _LIMITS.pass_width  # the longest free draft edges send; 0: the runner's
    max_batch: int = _RUNNER.max_batch
    max_kv_bytes: int = _RUNNER.max_kv_bytes
    token_budget: str = _RUNNER.token_budget  # positions per pass: auto, off or a number
    pass_latency_ms: float = _RUNNER.pass_latency_ms  # the latency aim bounding auto's
    max_batched_tokens: int = _RUNNER.max_batched_tokens  # positions a pass computes at most
    max_message_bytes: int = _LIMITS.max_message_bytes
    idle_timeout: float = _POLICY.idle_timeout
    # Seconds a client has to send a whole HTTP request or WebSocket handshake (slowloris).
    request_timeout: float = REQUEST_TIMEOUT
    drain_timeout: float = 30.0  # SIGTERM: seconds to let sessions move on before exiting
    auth_token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # An ONNX Runtime GenAI draft folder the browser edge's page may download and draft
    # with ("": none; the page drafts by lookup).
    web_draft: str = ""
    # Origins of pages that may open WebSocket sessions besides the server's own page
    # reached by localhost or an IP address (a browser names its page's; "*": any).
    allowed_origins: tuple[str, ...] = ()

    def limits(self) -> Limits:
        """The limits every session is held to: this section's settings of those names."""
        return Limits(**_named(self, Limits))

    def policy(self) -> ServicePolicy:
        """The service's limits on sessions: this section's settings of those names."""
        return ServicePolicy(**_named(self, ServicePolicy))

    def runner(self, threads: int | None = None) -> RunnerConfig:
        """How the target runs: this section's settings of those names (``threads``: the
        number resolved for the model, where the setting leaves it to the server)."""
        named = _named(self, RunnerConfig)
        if threads is not None:
            named["threads"] = threads
        return RunnerConfig(**named)


def _named(section: object, cls: type) -> dict[str, Any]:
    """The settings of ``section`` named as ``cls``' fields (by name, never by position)."""
    return {f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)}


@dataclass(frozen=True)
class EdgeConfig:
    """The ``[edge]`` section. Its settings are these fields and, flat beside them, the
    edge's options (``mode``, ``draft_source``, ``threshold``, ``k``, ``proactive``,
    ``max_support``, ``tree_width``, ``lookup_memory``, ``constrained_drafting``,
    ``fallback``, ``reconnect_attempts``, ``reconnect_delay``, ``reconnect_timeout``),
    parsed into ``options``."""

    server: str = ""
    draft_model: str = ""
    target_model: str = ""
    device: str = "auto"
    npu: bool = True  # whether device "npu" may use an NPU (else: the cpu, with a notice)
    dtype: str = "auto"
    threads: int = 0
    max_tokens: int = _SAMPLING.max_tokens
    temperature: float = _SAMPLING.temperature
    top_k: int = _SAMPLING.top_k
    top_p: float = _SAMPLING.top_p
    min_p: float = _SAMPLING.min_p
    repetition_penalty: float = _SAMPLING.repetition_penalty
    presence_penalty: float = _SAMPLING.presence_penalty
    frequency_penalty: float = _SAMPLING.frequency_penalty
    logit_bias: str = ""  # "ID:BIAS,ID:BIAS"
    # A constraint on the output (at most one): a JSON schema file, a regex, the strings
    # to choose from, an EBNF/GBNF or Lark grammar file.
    json_schema: str = ""
    regex: str = ""
    choice: tuple[str, ...] = ()
    grammar: str = ""
    # Heal text prompts' last token (spececd.healing); the Python API's default is off.
    token_healing: bool = True
    auth_token_file: str = ""
    tls_ca: str = ""
    tls_verify: bool = True
    target_tokenizer: str = ""  # with a server: the target's, when the draft's differs
    round_timeout: float = ROUND_TIMEOUT  # seconds without a reply: the link is deemed dead
    tool_call_parser: str = ""  # spececd api: hermes or llama3_json ("": tools refused)
    options: EdgeOptions = field(default_factory=EdgeOptions)

    def sampling(self) -> dict[str, Any]:
        """This section's sampling settings, by :class:`SamplingParams`' names (what
        ``Generator.stream`` takes); ``logit_bias`` parsed from its text."""
        named = {name: getattr(self, name) for name in SAMPLING_SETTINGS if hasattr(self, name)}
        return {**named, "logit_bias": parse_logit_bias(self.logit_bias),
                "constraint": self.constraint()}

    def constraint(self) -> Constraint | None:
        """The constraint ``json_schema``, ``regex``, ``choice`` or ``grammar`` asks for
        (files read here); None when none does. InputError when more than one does."""
        given = [name for name in ("json_schema", "regex", "choice", "grammar")
                 if getattr(self, name)]
        if len(given) > 1:
            raise InputError(f"{' and '.join(given)} both constrain the output: give one")
        if self.json_schema:
            return Constraint("json_schema", _read(self.json_schema, "JSON schema"))
        if self.regex:
            return Constraint("regex", self.regex)
        if self.choice:
            return Constraint.of_choices(self.choice)
        if self.grammar:
            return Constraint("grammar", _read(self.grammar, "grammar"))
        return None


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read the {what} file {path}: {exc.strerror}") from None


def parse_choices(value: Any) -> tuple[str, ...]:
    """A setting of several strings (``choice``, ``allowed_origins``): a list (a TOML
    array, a repeated flag) or, from the environment, one string separated by commas."""
    if isinstance(value, str):
        return tuple(c for c in (part.strip() for part in value.split(",")) if c)
    if isinstance(value, list | tuple) and all(isinstance(c, str) for c in value):
        return tuple(value)
    raise InputError(f"expected a list of strings, got {value!r}")


def parse_logit_bias(text: str) -> dict[int, float]:
    """``"ID:BIAS,ID:BIAS"`` as a dict; InputError naming the bad pair."""
    bias: dict[int, float] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        token, _, value = pair.partition(":")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise InputError(f"logit-bias takes ID:BIAS pairs separated by commas, e.g. "
                             f"'50256:-100,13:2.5'; got {pair!r}") from None
    return bias


Config = TypeVar("Config", ServerConfig, EdgeConfig)
SECTIONS: dict[type, str] = {ServerConfig: "server", EdgeConfig: "edge"}
# [devices] settings: (name there, the section it belongs to, the setting it is there)
DEVICE_SETTINGS = (("edge_device", "edge", "device"), ("cloud_device", "server", "device"))


def _convert(value: Any, kind: type) -> Any:
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        if kind is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise InputError(f"expected true or false, got {value!r}")
        try:
            return kind(text)
        except ValueError:
            raise InputError(f"expected {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # a setting of words or a number (token_budget = 256)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"expected {kind.__name__}, got {value!r}")
    return value


def settings(cls: type[Config]) -> dict[str, Callable[[Any], Any]]:
    """The section's settings, by name, each with the function that converts its value."""
    types = get_type_hints(cls)
    found: dict[str, Callable[[Any], Any]] = {
        f.name: (parse_choices if types[f.name] == tuple[str, ...]
                 else functools.partial(_convert, kind=types[f.name]))
        for f in fields(cls) if f.name != "options"}
    if cls is EdgeConfig:
        found.update({name: parse for name, parse in OPTION_SETTINGS.items()
                      if name != "reconnect"})  # the API's Reconnect object has no text form
    return found


def load(cls: type[Config], path: str | Path | None = None,
         flags: Mapping[str, Any] | None = None,
         environ: Mapping[str, str] | None = None,
         defaults: Mapping[str, Any] | None = None) -> Config:
    """Build a ``cls`` from defaults (``defaults`` overriding the class's own), the file's
    section, the environment and ``flags`` (entries that are None were not given)."""
    section = SECTIONS[cls]
    known = settings(cls)
    given: dict[str, tuple[Any, str]] = {  # name: (value, where it came from)
        name: (value, "default") for name, value in (defaults or {}).items()}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise InputError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InputError(f"config file {path} is not valid TOML: {exc}") from None
        table = data.get(section, {})
        unknown = set(table) - set(known)
        if unknown:
            raise InputError(f"config file {path}: unknown [{section}] setting(s) "
                             f"{', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        given.update({key: (value, f"{path} [{section}] {key}") for key, value in table.items()})
        for key, (value, source, name) in _device_settings(data, section, str(path)).items():
            if key in table and known[key](table[key]) != known[key](value):
                raise InputError(f"config file {path}: [{section}] {key} = {table[key]!r} "
                                 f"and {name} = {value!r} disagree; keep one")
            given[key] = (value, source)
    env = os.environ if environ is None else environ
    for name in known:
        var = f"SPECECD_{section.upper()}_{name.upper()}"
        if var in env:
            given[name] = (env[var], var)
    for name, value in (flags or {}).items():
        if name in known and value is not None:
            given[name] = (value, f"--{name.replace('_', '-')}")
    values: dict[str, Any] = {}
    for name, (value, source) in given.items():
        try:
            values[name] = known[name](value)
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None
    if cls is EdgeConfig:
        options = {name: values.pop(name) for name in OPTION_SETTINGS if name in values}
        values["options"] = EdgeOptions().with_settings(**options)
    return dataclasses.replace(cls(), **values)


def _device_settings(data: Mapping[str, Any], section: str, path: str
                     ) -> dict[str, tuple[Any, str, str]]:
    """The ``[devices]`` table's settings that belong to ``section``: setting: (value,
    where it came from, its name in the table)."""
    table = data.get("devices", {})
    known = {name for name, _, _ in DEVICE_SETTINGS} | {"npu"}
    if not isinstance(table, dict) or set(table) - known:
        raise InputError(f"config file {path}: [devices] takes {', '.join(sorted(known))}; "
                         f"got {', '.join(sorted(set(table) - known)) or table!r}")
    found = {setting: (table[name], f"{path} [devices] {name}", f"[devices] {name}")
             for name, where, setting in DEVICE_SETTINGS if where == section and name in table}
    npu = table.get("npu", {})
    if not isinstance(npu, dict) or set(npu) - {"enabled"}:
        raise InputError(f"config file {path}: [devices.npu] takes enabled = true or false")
    if "enabled" in npu:
        found["npu"] = (npu["enabled"], f"{path} [devices.npu] enabled",
                        "[devices.npu] enabled")
    return found


def auth_token(token_file: str, environ: Mapping[str, str] | None = None) -> str:
    """The bearer token: the file's first line if a file is named, else $SPECECD_AUTH_TOKEN."""
    if token_file:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as exc:
            raise InputError(f"cannot read auth token file {token_file}: {exc.strerror}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise InputError(f"auth token file {token_file} is empty")
        return token
    return (os.environ if environ is None else environ).get("SPECECD_AUTH_TOKEN", "")
