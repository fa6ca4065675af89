"""HTTP/JSON transport: SpecECD over plain HTTP/1.1 with keep-alive, both sides.

Server: :func:`serve` puts an :class:`~spececd.cloud.service.CloudService` behind uvicorn. One
port answers three kinds of client:

- the edge's own transport, SpecECD's binary frames over HTTP (``/v1/links``,
  :mod:`.links`): a draft, a hello or a generate request costs one exchange, hints
  ride on requests that do not wait, replies are long-polled;
- clients with their own drafter, in the seed's JSON shape (``/v1/sessions``,
  :mod:`.sessions`): create a session, prefill, verify drafts, delete;
- operators: ``/healthz``, ``/readyz`` (503 when full), ``/status``, ``/metrics``, and the
  OpenAPI schema at ``/openapi.json`` with a docs page at ``/docs`` (:mod:`.server`).

Every ``/v1`` endpoint needs ``Authorization: Bearer TOKEN`` when the engine has a token,
and every error is one typed JSON shape (:mod:`.common`).

Client: :class:`HttpTransport` (:mod:`.client`), the edge's blocking transport for
``http://`` and ``https://`` URLs, on the standard library's ``http.client``.
"""

from spececd.transports.http.client import HttpTransport
from spececd.transports.http.server import create_app, serve

__all__ = ["HttpTransport", "create_app", "serve"]
