"""What `spececd serve` answers browsers on its WebSocket port (spececd.transports.web): the
built page at /, its files, the draft offered to pages, nothing outside those folders, and a
plain 404 that says how to build the page where it is not built."""

from __future__ import annotations

from pathlib import Path

import pytest

from spececd.errors import InputError
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


def test_the_page_and_its_files_are_served_with_their_types(page: Path) -> None:
    web = WebEdge(page)
    index = web.answer("/?server=ws://elsewhere:8765")
    assert index is not None and index.status == 200
    assert index.content_type.startswith("text/html") and b"<title>edge" in index.body
    script, wasm = web.answer("/app.js"), web.answer("/ort.wasm")
    assert script is not None and script.content_type == "text/javascript"
    assert wasm is not None and wasm.content_type == "application/wasm"


def test_nothing_outside_the_page_is_served(page: Path) -> None:
    web = WebEdge(page)
    # Not the page's: left to the WebSocket upgrade, which refuses a plain GET.
    for path in ("/../secret.txt", "/%2e%2e/secret.txt", "/nope.js", "/sub/app.js"):
        assert web.answer(path) is None, path
    # The draft's folder is offered only when asked for.
    refused = web.answer("/draft/genai_config.json")
    assert refused is not None and refused.status == 404
    assert b"--web-draft" in refused.body


def test_the_draft_offered_to_pages_is_served_and_nothing_beside_it(page: Path) -> None:
    web = WebEdge.checked(str(MODELS / "draft-onnx"))
    config = web.answer("/draft/genai_config.json")
    assert config is not None and config.status == 200
    assert config.content_type == "application/json"
    for path in ("/draft/../target/config.json", "/draft/.hidden", "/draft/none.onnx"):
        reply = web.answer(path)
        assert reply is not None and reply.status == 404, path


def test_a_folder_that_is_no_onnx_draft_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"genai_config\.json"):
        WebEdge.checked(str(tmp_path))


def test_a_page_not_built_says_how_to_build_it(tmp_path: Path) -> None:
    reply = WebEdge(tmp_path / "dist").answer("/")
    assert reply is not None and reply.status == 404
    assert b"npm ci && npm run build" in reply.body
