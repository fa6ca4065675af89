"""The browser edge's files, served by ``spececd serve`` on its WebSocket port.

The page (``web/`` in the repository, built by ``npm ci && npm run build`` into
``web/dist``) drafts in the browser and verifies against this server over the same port's
WebSocket, in SpecECD's own protocol (docs/guide/browser.md). Plain ``GET``\\ s on that
port answer, before the upgrade: ``/`` the page, ``/<file>`` its built files, and
``/draft/<file>`` the files of the ONNX draft model offered to pages (``--web-draft``), if
any. The page also reads the target's tokenizer there (:mod:`spececd.transports.ops`).
Everything is read-only and public, as the operators' endpoints are: a page from another
origin (a static host pointed at this server) may read it (``Access-Control-Allow-Origin:
*``); generating still needs the auth token, which the page sends in its hello.
"""

from __future__ import annotations

import mimetypes
from dataclasses import dataclass
from pathlib import Path

from spececd.errors import InputError
from spececd.transports.ops import TEXT, Reply

# Where `npm run build` writes the page, in a checkout of the repository.
BUILT = Path(__file__).resolve().parents[3] / "web" / "dist"
NOT_BUILT = ("the browser edge is not built here: run `npm ci && npm run build` in the "
             "repository's web/ folder (Node.js 18 or newer), then restart the server\n")
DRAFT_PREFIX = "/draft/"
_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
          ".css": "text/css", ".html": "text/html; charset=utf-8",
          ".json": "application/json"}


@dataclass(frozen=True)
class WebEdge:
    """What the server offers browsers: the built page (``page``, a folder) and an ONNX
    Runtime GenAI draft folder (``draft``; None: none, the page drafts by lookup)."""

    page: Path = BUILT
    draft: Path | None = None

    @classmethod
    def checked(cls, draft: str) -> WebEdge:
        """The offer with ``draft`` (a folder path, "" for none), refused at start-up
        unless it is an ONNX Runtime GenAI folder."""
        if not draft:
            return cls()
        folder = Path(draft)
        if not (folder / "genai_config.json").is_file():
            raise InputError(f"--web-draft {draft}: not an ONNX Runtime GenAI folder (no "
                             "genai_config.json); make one with `spececd convert --to onnx`")
        return cls(draft=folder)

    def answer(self, path: str) -> Reply | None:
        """The reply to ``GET path``, or None when the path is not the page's (a WebSocket
        upgrade, or another endpoint)."""
        path = path.split("?", 1)[0]
        if path.startswith(DRAFT_PREFIX):
            if self.draft is None:
                return Reply(404, TEXT,
                               b"this server offers no draft model to browsers: start it "
                               b"with --web-draft DIR\n")
            return _file(self.draft, path[len(DRAFT_PREFIX):])
        name = "index.html" if path == "/" else path[1:]
        if "/" in name or not name or not (path == "/" or (self.page / name).is_file()):
            return None
        if not (self.page / "index.html").is_file():
            return Reply(404, TEXT, NOT_BUILT.encode())
        return _file(self.page, name)


def _file(folder: Path, name: str) -> Reply:
    """``folder``'s file ``name`` (one plain name: no folders, nothing hidden), or 404."""
    target = folder / name
    if "/" in name or "\\" in name or name.startswith(".") or not target.is_file():
        return Reply(404, TEXT, f"no file {name!r}\n".encode())
    kind = _TYPES.get(target.suffix) or mimetypes.guess_type(name)[0] \
        or "application/octet-stream"
    return Reply(200, kind, target.read_bytes())
