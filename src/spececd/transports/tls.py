"""TLS contexts for every transport: the server's from a certificate and key, the client's
trusting the system's CAs, a given CA file, or (``verify=False``) anything."""

from __future__ import annotations

import ssl


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def client_ssl_context(cafile: str | None = None, verify: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cafile)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
