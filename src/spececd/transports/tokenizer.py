"""The edge's side of the server's tokenizer endpoints: fetch the target's tokenizer.

``GET /v1/tokenizer/fingerprint`` first, and ``GET /v1/tokenizer`` (the bundle of
:mod:`spececd.backends.bundle`) only when the fingerprint differs from the draft's and no
copy is cached; over plain HTTP or HTTPS, whatever transport the edge then speaks (a
``ws://`` server's tokenizer is at ``http://`` on the same address).
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.error
import urllib.request

from spececd.backends.base import Tokenizer
from spececd.backends.bundle import PATH, cache_dir, load
from spececd.errors import InputError
from spececd.protocol.messages import Fingerprint
from spececd.transports.tls import client_ssl_context

log = logging.getLogger(__name__)

HTTP_BASES = {"ws": "http", "wss": "https", "http": "http", "https": "https"}


def fetch(server: str, own: Fingerprint | None, cafile: str | None = None,
          verify: bool = True, timeout: float = 5.0) -> tuple[Tokenizer, int] | None:
    """The server's target tokenizer when it differs from ``own`` (the draft's; None: the
    edge has no draft model, and needs it); None when they agree, or when the server
    cannot say (gRPC, an older server, a GGUF target, unreachable now): the handshake then
    decides, with its own message."""
    scheme, _, rest = server.partition("://")
    if scheme not in HTTP_BASES:
        return None
    base = f"{HTTP_BASES[scheme]}://{rest.rstrip('/')}"
    context = None
    if base.startswith("https"):
        context = client_ssl_context(cafile, verify)

    def get(path: str) -> bytes:
        with urllib.request.urlopen(base + path, timeout=timeout, context=context) as reply:
            return reply.read()  # type: ignore[no-any-return]

    try:
        raw = json.loads(get(PATH + "/fingerprint"))
        theirs = Fingerprint(int(raw["vocab_size"]), str(raw["tokenizer_hash"]))
    except (OSError, ValueError, KeyError, ssl.SSLError) as exc:
        log.info("no tokenizer fingerprint from %s (%s)", base, exc)
        return None
    if theirs == own:
        return None
    cached = cache_dir() / f"{theirs.tokenizer_hash}.msgpack"
    if cached.is_file():
        return load(cached.read_bytes(), theirs)
    try:
        data = get(PATH)
    except urllib.error.HTTPError as exc:
        raise InputError(f"the server's target has another tokenizer than the draft and "
                         f"cannot share it (HTTP {exc.code}): pass --target-tokenizer") from None
    except OSError as exc:
        log.info("could not fetch the tokenizer from %s (%s)", base, exc)
        return None
    loaded = load(data, theirs)
    cached.parent.mkdir(parents=True, exist_ok=True)
    temporary = cached.with_suffix(".tmp")
    temporary.write_bytes(data)
    temporary.replace(cached)
    log.info("fetched the target's tokenizer from %s (cached in %s)", base, cached)
    return loaded
