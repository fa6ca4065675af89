"""The playground's files, served by ``spececd serve`` on its WebSocket port.

The page (``web/`` in the repository, built by ``npm ci && npm run build`` into
``web/dist``; ``spececd api`` serves it too, in its API mode) drafts in the browser here
and verifies against this server over the same port's WebSocket, in SpecECD's own protocol
(docs/guide/browser.md). Plain ``GET``\\ s on that
port answer, before the upgrade: ``/`` the page, ``/<file>`` its built files, and
``/draft/<file>`` the files of the ONNX draft model offered to pages (``--web-draft``), if
any. The page also reads the target's tokenizer there (:mod:`spececd.transports.ops`).
Everything is read-only and public, as the operators' endpoints are: a page from another
origin (a static host pointed at this server) may read it (``Access-Control-Allow-Origin:
*``); generating still needs the auth token, which the page sends in its hello.

Files are read in a worker thread, never on the event loop that serves verification, and
only when the browser does not hold them already: each answer carries an ``ETag`` (the
file's size and modification time) with ``Cache-Control: no-cache``, so a page loaded again
revalidates its 28 MB of WebAssembly and its draft and gets ``304 Not Modified``. The page
is cross-origin isolated (``Cross-Origin-Opener-Policy: same-origin``,
``Cross-Origin-Embedder-Policy: require-corp``), which gives ONNX Runtime Web the shared
memory it needs to draft on several WebAssembly threads. (``spececd api`` serves the same
files with Starlette's ``StaticFiles``, which also answers ``HEAD`` and ranges; websockets'
handshake takes ``GET`` alone, so this port sends whole files.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import mimetypes
import mmap
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from spececd.backends import bundle
from spececd.errors import InputError
from spececd.transports.ops import TEXT, Reply

log = logging.getLogger(__name__)

# Where `npm run build` writes the page in a checkout of the repository, and where a wheel
# carries it (setup.py); the checkout's where both are, so that a rebuilt page is served.
CHECKOUT = Path(__file__).resolve().parents[3] / "web" / "dist"
PACKAGED = Path(__file__).resolve().parents[1] / "webpage"
BUILT = PACKAGED if (PACKAGED / "index.html").is_file() \
    and not (CHECKOUT / "index.html").is_file() else CHECKOUT
NOT_BUILT = ("the playground page is not built here: run `npm ci && npm run build` in the "
             "repository's web/ folder (Node.js 18 or newer), then restart the server (a "
             "wheel built with npm on the machine carries the page)\n")
DRAFT_PREFIX = "/draft/"
_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
          ".css": "text/css", ".html": "text/html; charset=utf-8",
          ".json": "application/json"}
# Every file of the page and of its draft: revalidated by its ETag on each load, loadable
# by isolated pages of other origins, and the page cross-origin isolated (WebAssembly
# threads). (Pages of other origins may read them: the server adds the CORS header.)
HEADERS = (("Cache-Control", "no-cache"), ("Cross-Origin-Opener-Policy", "same-origin"),
           ("Cross-Origin-Embedder-Policy", "require-corp"),
           ("Cross-Origin-Resource-Policy", "cross-origin"))
# Sent with the page's files: which SpecECD server sent them ("edge" here, "api" from
# `spececd api`), so that the page starts in that mode (web/src/browser-edge.js).
SERVES = "X-SpecECD-Serves"


@dataclass(frozen=True)
class WebEdge:
    """What the server offers browsers: the built page (``page``, a folder) and an ONNX
    Runtime GenAI draft folder (``draft``; None: none, the page drafts by lookup)."""

    page: Path = BUILT
    draft: Path | None = None

    @classmethod
    def checked(cls, draft: str) -> WebEdge:
        """The offer with ``draft`` ("" for none): an ONNX Runtime GenAI folder, served as it
        is, or a transformers model folder, exported once to fp32 ONNX for browsers
        (:func:`browser_form`); anything else is refused at start-up."""
        if not draft:
            return cls()
        folder = Path(draft)
        if (folder / "genai_config.json").is_file():
            if _quantized(folder):
                log.warning(
                    "--web-draft %s has quantized weights, which ONNX Runtime Web runs slower "
                    "than fp32 (the default draft: 0.90x against 1.45x the page's cloud-only "
                    "in docs/guide/browser.md); give the transformers folder instead (the "
                    "server exports fp32 for browsers) or `spececd convert --to onnx` one",
                    draft)
            return cls(draft=folder)
        if (folder / "config.json").is_file():
            return cls(draft=browser_form(folder))
        raise InputError(f"--web-draft {draft}: neither an ONNX Runtime GenAI folder (no "
                         "genai_config.json) nor a transformers model folder (no "
                         "config.json)")

    async def answer(self, path: str, if_none_match: str | None = None) -> Reply | None:
        """The reply to ``GET path`` (``if_none_match``: the request's ``If-None-Match``),
        or None when the path is not the page's (a WebSocket upgrade, or another
        endpoint). The file is read in a worker thread."""
        path = path.split("?", 1)[0]
        if path.startswith(DRAFT_PREFIX):
            if self.draft is None:
                return Reply(404, TEXT,
                               b"this server offers no draft model to browsers: start it "
                               b"with --web-draft DIR\n")
            return await _file(self.draft, path[len(DRAFT_PREFIX):], if_none_match)
        name = "index.html" if path == "/" else path[1:]
        if "/" in name or not name or not (path == "/" or (self.page / name).is_file()):
            return None
        if not (self.page / "index.html").is_file():
            return Reply(404, TEXT, NOT_BUILT.encode())
        return await _file(self.page, name, if_none_match, ((SERVES, "edge"),))


def content_type(name: str) -> str | None:
    """A page file's content type: fixed for the page's own kinds (a platform's MIME table
    may call a module script text/plain, which browsers refuse), else the usual guess."""
    return _TYPES.get(Path(name).suffix) or mimetypes.guess_type(name)[0]


async def _file(folder: Path, name: str, if_none_match: str | None,
                more: tuple[tuple[str, str], ...] = ()) -> Reply:
    """``folder``'s file ``name`` (one plain name: no folders, nothing hidden), 304 where
    the browser holds it (``if_none_match`` names its ETag), or 404; ``more``: headers
    beside :data:`HEADERS` and the ETag."""
    target = folder / name
    if "/" in name or "\\" in name or name.startswith(".") or not target.is_file():
        return Reply(404, TEXT, f"no file {name!r}\n".encode())
    kind = content_type(name) or "application/octet-stream"
    stat = target.stat()
    tag = f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"'
    headers = (*HEADERS, *more, ("ETag", tag))
    if if_none_match is not None and (if_none_match.strip() == "*" or tag in (
            t.strip().removeprefix("W/") for t in if_none_match.split(","))):
        return Reply(304, kind, b"", headers)
    return Reply(200, kind, await asyncio.to_thread(target.read_bytes), headers)


def _quantized(folder: Path) -> bool:
    """Whether an ONNX Runtime GenAI folder's graph has quantized (int8, int4) weights: the
    model builder writes those as MatMulNBits nodes."""
    try:
        config = json.loads((folder / "genai_config.json").read_text())
        graph = folder / config["model"]["decoder"]["filename"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--web-draft {folder}: its genai_config.json names no decoder "
                         f"file ({exc!r}); make the folder with `spececd convert --to onnx`"
                         ) from None
    if not graph.is_file() or not graph.stat().st_size:
        return False
    with graph.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(b"MatMulNBits") >= 0


def browser_form(model_dir: Path) -> Path:
    """The fp32 ONNX Runtime GenAI form of a transformers draft, the fastest in a browser
    (ONNX Runtime Web's WebAssembly kernels for quantized weights are slow): exported once
    with ``spececd convert --to onnx``'s exporter into the cache
    (``$XDG_CACHE_HOME/spececd/web-drafts``, default ``~/.cache``), keyed by the model's
    files and the exporter's versions, and reused while they are unchanged. Servers that
    start at once each export into a folder of their own; the first to finish names the
    export, the others use it."""
    from importlib.metadata import PackageNotFoundError, version

    from spececd.backends.onnx import export

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return ""

    files = sorted(f for f in model_dir.iterdir() if f.is_file())
    key = hashlib.sha256(repr(([(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                for f in files],
                               installed("spececd"), installed("onnxruntime-genai"))).encode()
                         ).hexdigest()[:16]
    out = bundle.cache_dir("web-drafts") / f"{model_dir.resolve().name}-{key}"
    if (out / "genai_config.json").is_file():
        return out
    log.info("exporting %s to fp32 ONNX for browsers, once, into %s", model_dir, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        export(model_dir, partial, "fp32")
        try:
            partial.rename(out)  # fails where another server's export got there first
        except OSError:
            if not (out / "genai_config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out
