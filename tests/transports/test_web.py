"""What `spececd serve` answers browsers on its WebSocket port (spececd.transports.web): the
built page at /, its files, the draft offered to pages, nothing outside those folders, and a
plain 404 that says how to build the page where it is not built."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from spececd.errors import InputError
from spececd.transports.ops import Reply
from spececd.transports.web import WebEdge
from tests.builders import MODELS


@pytest.fixture
def page(tmp_path: Path) -> Path:
    built = tmp_path / "dist"
    built.mkdir()
    (built / "index.html").write_text("<!doctype html><title>edge</title>")
    (built / "app.js").write_text("export {};")
    (built / "ort.wasm").write_bytes(b"\0asm")
    (tmp_path / "secret.txt").write_text("not served")
    return built


def answer(web: WebEdge, path: str, if_none_match: str | None = None) -> Reply | None:
    return asyncio.run(web.answer(path, if_none_match))


def test_the_page_and_its_files_are_served_with_their_types(page: Path) -> None:
    web = WebEdge(page)
    index = answer(web, "/?server=ws://elsewhere:8765")
    assert index is not None and index.status == 200
    assert index.content_type.startswith("text/html") and b"<title>edge" in index.body
    script, wasm = answer(web, "/app.js"), answer(web, "/ort.wasm")
    assert script is not None and script.content_type == "text/javascript"
    assert wasm is not None and wasm.content_type == "application/wasm"


def test_nothing_outside_the_page_is_served(page: Path) -> None:
    web = WebEdge(page)
    # Not the page's: left to the WebSocket upgrade, which refuses a plain GET.
    for path in ("/../secret.txt", "/%2e%2e/secret.txt", "/nope.js", "/sub/app.js"):
        assert answer(web, path) is None, path
    # The draft's folder is offered only when asked for.
    refused = answer(web, "/draft/genai_config.json")
    assert refused is not None and refused.status == 404
    assert b"--web-draft" in refused.body


def test_the_draft_offered_to_pages_is_served_and_nothing_beside_it(page: Path) -> None:
    web = WebEdge.checked(str(MODELS / "draft-onnx"))
    config = answer(web, "/draft/genai_config.json")
    assert config is not None and config.status == 200
    assert config.content_type == "application/json"
    for path in ("/draft/../target/config.json", "/draft/.hidden", "/draft/none.onnx"):
        reply = answer(web, path)
        assert reply is not None and reply.status == 404, path


def test_a_folder_that_is_no_draft_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"genai_config\.json.*config\.json"):
        WebEdge.checked(str(tmp_path))


def test_a_quantized_onnx_draft_is_served_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="spececd.transports.web"):
        web = WebEdge.checked(str(MODELS / "draft-onnx"))  # int8 (MatMulNBits)
    assert web.draft == MODELS / "draft-onnx"
    assert "quantized weights" in caplog.text and "fp32" in caplog.text


def test_a_transformers_draft_is_offered_to_pages_in_fp32_exported_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("onnxruntime_genai")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    web = WebEdge.checked(str(MODELS / "draft"))
    assert web.draft is not None and web.draft.is_relative_to(tmp_path / "spececd")
    config = answer(web, "/draft/genai_config.json")
    assert config is not None and config.status == 200
    with caplog.at_level(logging.WARNING, logger="spececd.transports.web"):
        assert WebEdge.checked(str(web.draft)).draft == web.draft
    assert "quantized" not in caplog.text  # fp32
    # The second start reuses the export.
    from spececd.backends import onnx

    def export(*_: object) -> Path:
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx, "export", export)
    assert WebEdge.checked(str(MODELS / "draft")).draft == web.draft


def test_a_page_not_built_says_how_to_build_it(tmp_path: Path) -> None:
    reply = answer(WebEdge(tmp_path / "dist"), "/")
    assert reply is not None and reply.status == 404
    assert b"npm ci && npm run build" in reply.body


def test_a_file_the_browser_holds_is_not_sent_again(page: Path) -> None:
    """Each file carries an ETag and is revalidated on each load (a page loaded again gets
    304 for its 28 MB of WebAssembly and its draft); a changed file is sent again. Every
    file says the page is cross-origin isolated (WebAssembly threads)."""
    web = WebEdge(page)
    first = answer(web, "/ort.wasm")
    assert first is not None and first.status == 200
    headers = dict(first.headers)
    assert headers["Cache-Control"] == "no-cache"
    assert headers["Cross-Origin-Opener-Policy"] == "same-origin"
    assert headers["Cross-Origin-Embedder-Policy"] == "require-corp"
    tag = headers["ETag"]
    for held in (tag, f"W/{tag}", f'"other", {tag}', "*"):
        again = answer(web, "/ort.wasm", held)
        assert again is not None and (again.status, again.body) == (304, b""), held
    assert answer(web, "/ort.wasm", '"other"').status == 200  # type: ignore[union-attr]
    (page / "ort.wasm").write_bytes(b"\0asm, rebuilt")
    changed = answer(web, "/ort.wasm", tag)
    assert changed is not None and changed.status == 200 and changed.body == b"\0asm, rebuilt"


def test_servers_exporting_the_same_draft_at_once_each_get_a_whole_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two servers starting at once both export; the first to finish names the export, the
    other uses it, and neither deletes what the other serves."""
    from spececd.backends import onnx
    from spececd.transports import web

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tmp_path / "draft"
    model.mkdir()
    (model / "config.json").write_text("{}")
    outs: list[Path] = []
    started: list[Path] = []

    def export(_: Path, out: Path, precision: str) -> Path:
        started.append(out)
        if len(started) == 1:  # the other server starts and finishes while this one exports
            outs.append(web.browser_form(model))
        (out / "genai_config.json").write_text(f'{{"who": {len(started)}}}')
        return out

    monkeypatch.setattr(onnx, "export", export)
    ours = web.browser_form(model)
    assert ours == outs[0]
    assert started[0] != started[1]  # each in a folder of its own
    assert (ours / "genai_config.json").read_text() == '{"who": 2}'  # the first done, whole
    assert [p.name for p in ours.parent.iterdir()] == [ours.name]  # no partial left
