"""Configuration's one home: typed settings for the server and the edge.

Each value comes from, in increasing order of precedence:

1. the defaults below;
2. ``config.toml`` (``--config FILE``; sections ``[server]`` and ``[edge]``);
3. environment variables ``SPECECD_SERVER_<NAME>`` / ``SPECECD_EDGE_<NAME>`` (upper case,
   e.g. ``SPECECD_SERVER_PORT=9000``), and ``SPECECD_AUTH_TOKEN`` for the bearer token;
4. command-line flags.

``config.example.toml`` in the repository lists every setting.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from spececd.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]


@dataclass(frozen=True)
class ServerConfig:
    target_model: str = ""
    host: str = "127.0.0.1"
    port: int = 8765  # WebSocket; -1: none
    grpc_port: int = -1  # -1: no gRPC listener; 0: any free port
    http_port: int = -1  # -1: no HTTP listener; 0: any free port
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    max_sessions: int = 64
    max_context: int = 4096
    max_draft: int = 64
    max_batch: int = 32
    max_kv_bytes: int = 0
    max_message_bytes: int = 1 << 20
    idle_timeout: float = 300.0
    auth_token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""


@dataclass(frozen=True)
class EdgeConfig:
    server: str = ""
    draft_model: str = ""
    target_model: str = ""
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    mode: str = "exact"
    k: str = "auto"
    proactive: str = "auto"
    max_support: int = 64
    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    auth_token_file: str = ""
    tls_ca: str = ""
    tls_verify: bool = True
    reconnect_attempts: int = 5
    reconnect_delay: float = 0.25
    fallback: str = "none"


Config = TypeVar("Config", ServerConfig, EdgeConfig)
SECTIONS: dict[type, str] = {ServerConfig: "server", EdgeConfig: "edge"}


def _convert(value: Any, kind: type, source: str) -> Any:
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        if kind is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise InputError(f"{source}: expected true or false, got {value!r}")
        try:
            return kind(text)
        except ValueError:
            raise InputError(f"{source}: expected {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. k = 4 where "auto" is also allowed
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"{source}: expected {kind.__name__}, got {value!r}")
    return value


def load(cls: type[Config], path: str | Path | None = None,
         flags: Mapping[str, Any] | None = None,
         environ: Mapping[str, str] | None = None,
         defaults: Mapping[str, Any] | None = None) -> Config:
    """Build a ``cls`` from defaults (``defaults`` overriding the class's own), the file's
    section, the environment and ``flags`` (entries that are None were not given)."""
    section = SECTIONS[cls]
    types = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    values: dict[str, Any] = dict(defaults or {})
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise InputError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InputError(f"config file {path} is not valid TOML: {exc}") from None
        table = data.get(section, {})
        unknown = set(table) - names
        if unknown:
            raise InputError(f"config file {path}: unknown [{section}] setting(s) "
                             f"{', '.join(sorted(unknown))}; known: {', '.join(sorted(names))}")
        for key, value in table.items():
            values[key] = _convert(value, types[key], f"{path} [{section}] {key}")
    env = os.environ if environ is None else environ
    for name in names:
        var = f"SPECECD_{section.upper()}_{name.upper()}"
        if var in env:
            values[name] = _convert(env[var], types[name], var)
    for name, value in (flags or {}).items():
        if name in names and value is not None:
            values[name] = _convert(value, types[name], f"--{name.replace('_', '-')}")
    return dataclasses.replace(cls(), **values)


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
