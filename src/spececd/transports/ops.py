"""The operators' endpoints, written once for every server that speaks HTTP.

``GET /healthz`` (alive: 200 while the service's runner can serve), ``GET /readyz`` (200
while a session can be opened, else 503), ``GET /status`` (a JSON summary), ``GET
/metrics`` (Prometheus) and the target's tokenizer for edges whose draft has another
(``GET /v1/tokenizer`` and ``/v1/tokenizer/fingerprint``). None needs a token. The
WebSocket server answers them on its own port before the upgrade; the HTTP server mounts
them as routes. Each is a pure function of the service: a status, a content type, a body.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from spececd.backends import bundle
from spececd.cloud.service import CloudService

TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()  # any besides the content's type and length


@dataclass(frozen=True)
class Endpoint:
    """``name``: the route's name (the HTTP API's operation ids derive from it);
    ``failure``: what an answer other than 200 (``failure_status``) means, for the API's
    documentation ("" when it always answers 200)."""

    name: str
    path: str
    summary: str
    answer: Callable[[CloudService], Reply]
    failure: str = ""
    failure_status: int = 503


def _text(status: int, text: str) -> Reply:
    return Reply(status, TEXT, text.encode())


def _healthz(service: CloudService) -> Reply:
    return _text(200, "ok\n") if service.alive() else _text(503, "engine failed\n")


def _readyz(service: CloudService) -> Reply:
    return _text(200, "ready\n") if service.ready() else _text(503, "full\n")


def _status(service: CloudService) -> Reply:
    return Reply(200, "application/json", (json.dumps(service.status()) + "\n").encode())


def _metrics(service: CloudService) -> Reply:
    return Reply(200, "text/plain; version=0.0.4; charset=utf-8", service.metrics.exposition())


def _fingerprint(service: CloudService) -> Reply:
    return Reply(200, "application/json", bundle.fingerprint_json(service.fingerprint))


def _tokenizer(service: CloudService) -> Reply:
    data = service.tokenizer_bundle()
    if data is None:
        return _text(404, bundle.NOT_EXPORTABLE)
    return Reply(200, "application/vnd.msgpack", data)


ENDPOINTS = (
    Endpoint("healthz", "/healthz", "Alive: 200 while the engine can serve.", _healthz,
             "the engine has failed: restart the server"),
    Endpoint("readyz", "/readyz", "200 while a session can be opened.", _readyz,
             "full: no session can be opened now"),
    Endpoint("status", "/status",
             "Sessions, KV cache, evictions, errors by code, uptime and model.", _status),
    Endpoint("metrics", "/metrics", "Prometheus metrics.", _metrics),
    Endpoint("tokenizer_fingerprint", bundle.PATH + "/fingerprint",
             "The target tokenizer's fingerprint (what the handshake compares).", _fingerprint),
    Endpoint("tokenizer", bundle.PATH, "The target's tokenizer (a msgpack bundle), for edges "
             "whose draft has another.", _tokenizer, "the tokenizer cannot be exported", 404),
)
BY_PATH = {endpoint.path: endpoint for endpoint in ENDPOINTS}
