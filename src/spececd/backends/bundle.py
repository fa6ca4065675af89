"""The target's tokenizer, shared by the server with edges whose draft has another one.

An edge that drafts across two tokenizers (:mod:`spececd.edge.retokenize`), or with no
draft model at all (lookup drafts, :mod:`spececd.edge.lookup`), must speak the target's
token ids, so it needs the target's tokenizer. Rather than making every user find
it, the server serves it: ``GET /v1/tokenizer/fingerprint`` (JSON, what the handshake
compares) and ``GET /v1/tokenizer`` (a msgpack bundle: the fingerprint, the end-of-sequence
ids and the files transformers rebuilds the tokenizer from), on the WebSocket and HTTP
ports. The edge asks for the fingerprint when it loads; only when it differs from its
draft's (or it has no draft) does it fetch the bundle, load it, check that the rebuilt
tokenizer has exactly the server's fingerprint, and cache it by that fingerprint's hash
(``$XDG_CACHE_HOME/spececd/tokenizers``, default ``~/.cache``). A GGUF target's tokenizer
cannot be exported as transformers files: such a server answers 404, and the edge then
needs ``--target-tokenizer``. So does an edge on gRPC, which has no plain HTTP.

This module makes and reads the bundle; asking a server for it is the edge's side of
those endpoints, :func:`spececd.transports.tokenizer.fetch` (the server's is
:mod:`spececd.transports.ops`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]

from spececd.backends.base import Tokenizer, tokenizer_fingerprint
from spececd.errors import InputError
from spececd.protocol.messages import Fingerprint

PATH = "/v1/tokenizer"
NOT_EXPORTABLE = "this target's tokenizer cannot be exported: use --target-tokenizer\n"


def fingerprint_json(fingerprint: Fingerprint) -> bytes:
    return json.dumps({"vocab_size": fingerprint.vocab_size,
                       "tokenizer_hash": fingerprint.tokenizer_hash}).encode()


def pack(tokenizer: Tokenizer, vocab_size: int) -> bytes | None:
    """The bundle a server serves; None when the tokenizer cannot be exported."""
    files = tokenizer.files()
    if not files:
        return None
    fingerprint = tokenizer_fingerprint(tokenizer, vocab_size)
    return msgpack.packb({  # type: ignore[no-any-return]
        "vocab_size": fingerprint.vocab_size, "tokenizer_hash": fingerprint.tokenizer_hash,
        "eos_token_ids": list(tokenizer.eos_token_ids), "files": files}, use_bin_type=True)


def cache_dir(kind: str = "tokenizers") -> Path:
    """SpecECD's cache folder for ``kind`` (tokenizers, the browsers' drafts):
    ``$XDG_CACHE_HOME/spececd/<kind>``, default ``~/.cache``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "spececd" / kind


def load(data: bytes, expected: Fingerprint) -> tuple[Tokenizer, int]:
    """Rebuild the tokenizer of a bundle and check it is exactly ``expected``: with
    transformers where it is installed, else from its ``tokenizer.json`` with the
    ``tokenizers`` package alone (an edge with no draft model needs no more)."""
    from spececd.backends.hf_tokenizer import HFTokenizer, JsonTokenizer

    try:
        bundle: dict[str, Any] = msgpack.unpackb(data, raw=False)
        files: dict[str, bytes] = bundle["files"]
        eos = tuple(int(t) for t in bundle["eos_token_ids"])
    except Exception as exc:
        raise InputError(f"the server's tokenizer bundle is malformed ({exc}): pass "
                         f"--target-tokenizer") from None
    for name in files:
        if "/" in name or name.startswith("."):
            raise InputError(f"the server's tokenizer bundle names a bad file {name!r}")
    tokenizer: Tokenizer
    if importlib.util.find_spec("transformers") is not None:
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as folder:
            for name, content in files.items():
                (Path(folder) / name).write_bytes(content)
            tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(folder), eos)
    elif importlib.util.find_spec("tokenizers") is not None:
        tokenizer = JsonTokenizer(files, eos)
    else:
        raise InputError("speaking the target's token ids here needs its tokenizer: pip "
                         "install tokenizers (or transformers; no torch needed)")
    vocab = expected.vocab_size
    got = tokenizer_fingerprint(tokenizer, vocab)
    if got != expected or len(tokenizer.vocab_tokens()) < vocab:
        raise InputError(f"the server's tokenizer does not rebuild identically here "
                         f"(hash {got.tokenizer_hash[:12]}, expected "
                         f"{expected.tokenizer_hash[:12]}): pass --target-tokenizer")
    return tokenizer, vocab
