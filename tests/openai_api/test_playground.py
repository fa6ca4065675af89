"""The playground (`GET /` of `spececd api`: the page built from web/, in its API mode) in
a real headless Chromium, against a real `spececd api` on loopback: its files served with
ETags, HEAD, ranges and the page's headers beside the API's routes; the page starts in its
API mode and offers the browser edge; it loads with nothing from outside, streams a greedy
completion coloured by source whose text is the non-streamed completion's, fills in its
statistics, compares with cloud-only, follows a JSON schema (its forced tokens in their own
colour), drafts from a predicted output (its tokens in their own colour), and shows the
server's message on a bad request.

Chromium is Debian's (/usr/lib/chromium/chromium), driven by Playwright; set
SPECECD_SCREENSHOT to a path to keep a screenshot of the comparison (docs/playground.png),
SPECECD_PREDICTION_SCREENSHOT for one with a predicted output.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("torch")
sync_api = pytest.importorskip("playwright.sync_api")

from spececd.transports.web import BUILT  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402

CHROMIUM = Path("/usr/lib/chromium/chromium")
PROMPT = "class Stack:\n    def __init__(self):\n        "
MAX_TOKENS = 48

pytestmark = [
    requires_default_pair,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (Debian's "
                       "chromium package; Playwright's own browser download is not used)"),
    pytest.mark.skipif(not (BUILT / "index.html").is_file(), reason="the playground page is "
                       "not built: run `npm ci && npm run build` in web/"),
]


@dataclass
class Page:
    """A browser tab on the playground, with what it logged and asked for."""

    tab: Any
    console_errors: list[str] = field(default_factory=list)
    hosts: set[str] = field(default_factory=set)

    def number(self, selector: str) -> float:
        text = self.tab.text_content(selector)
        try:
            return float(text)
        except ValueError:
            raise AssertionError(f"{selector} shows {text!r}, not a number") from None

    def generate(self) -> None:
        """Clicks Generate and waits until the page has finished, asserting it succeeded."""
        self.tab.click("#generate")
        self.tab.wait_for_function("document.body.dataset.state !== 'running'",
                                   timeout=30_000)
        state = self.tab.evaluate("document.body.dataset.state")
        assert state == "done", f"{state}: {self.tab.text_content('#error')}"

    def text(self, selector: str) -> str:
        return str(self.tab.eval_on_selector_all(
            selector, "els => els.map(e => e.textContent).join('')"))


@pytest.fixture(scope="module")
def api() -> Iterator[ServerProcess]:
    # The default draft, as `spececd api` picks it: its fastest form installed here
    proc = ServerProcess(MODELS / "target", command="api", scheme="http")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield browser
        browser.close()


@pytest.fixture
def page(api: ServerProcess, browser: Any) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    tab = context.new_page()
    page = Page(tab)

    def on_console(message: Any) -> None:
        if message.type == "error":
            page.console_errors.append(message.text)

    tab.on("console", on_console)
    tab.on("pageerror", lambda exc: page.console_errors.append(str(exc)))
    tab.on("request", lambda request: page.hosts.add(urlsplit(request.url).hostname or ""))
    tab.goto(api.url + "/")
    tab.wait_for_function("document.getElementById('model').textContent === 'spececd'")
    tab.uncheck("#compare")  # the tests that compare ask for it
    tab.fill("#prompt", PROMPT)
    tab.fill("#max-tokens", str(MAX_TOKENS))
    tab.fill("#temperature", "0")
    yield page
    context.close()


def completion(api: ServerProcess, **body: Any) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{api.url}/v1/completions", json.dumps({"model": "spececd", **body}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def fetch(url: str, method: str = "GET", **headers: str) -> tuple[int, Any, bytes]:
    """The status, headers and body of a request (an error status too)."""
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_the_page_is_served_as_static_files_beside_the_api(api: ServerProcess) -> None:
    """The built page (web/dist) as Starlette's StaticFiles serves it: ETag and 304, HEAD,
    ranges; with the headers the page needs (cross-origin isolated; which server sent it);
    and the API's own routes and errors unchanged around it."""
    status, headers, body = fetch(api.url + "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"<title>SpecECD playground</title>" in body
    assert headers["x-spececd-serves"] == "api"
    assert headers["cross-origin-opener-policy"] == "same-origin"
    assert headers["cross-origin-embedder-policy"] == "require-corp"
    assert fetch(api.url + "/", **{"If-None-Match": headers["etag"]})[0] == 304

    status, headers, body = fetch(api.url + "/app.js", "HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 1000
    assert headers["content-type"].startswith("text/javascript")
    wasm = next(BUILT.glob("*.wasm")).name
    status, headers, body = fetch(f"{api.url}/{wasm}", Range="bytes=0-7")
    assert status == 206 and body == b"\0asm\1\0\0\0"  # WebAssembly's magic and version

    assert json.loads(fetch(api.url + "/healthz")[2]) == {"status": "ok"}
    assert json.loads(fetch(api.url + "/v1/models")[2])["data"][0]["id"] == "spececd"
    status, _, body = fetch(api.url + "/no-such-file.js")
    assert status == 404 and "error" in json.loads(body)
    # A client whose base URL lacks /v1 posts to a path no route has: OpenAI's 404, as
    # before the page's files were served beside the API (not a 405 of the page's route).
    status, _, body = fetch(api.url + "/completions", "POST")
    assert status == 404 and "error" in json.loads(body)


def test_page_loads_with_nothing_from_outside(page: Page) -> None:
    assert page.tab.title() == "SpecECD playground"
    assert page.tab.is_hidden("#error")
    assert page.console_errors == []
    assert page.hosts == {"127.0.0.1"}


def test_the_page_starts_as_the_api_and_offers_the_browser_edge(page: Page) -> None:
    """One app: served by `spececd api` it asks the API; switched to the browser edge it
    asks for a `spececd serve` to draft against (none named: the usual port)."""
    assert page.tab.evaluate("document.body.dataset.mode") == "api"
    assert page.tab.is_visible("#api-key") and page.tab.is_hidden("#server")
    page.tab.click("label:has(input[name=where][value=edge])")
    assert page.tab.evaluate("document.body.dataset.mode") == "edge"
    assert page.tab.is_hidden("#api-key") and page.tab.is_hidden("#constraint")
    assert page.tab.input_value("#server") == "ws://127.0.0.1:8765"
    page.tab.click("label:has(input[name=where][value=api])")
    assert page.tab.is_visible("#constraint") and page.tab.is_hidden("#server")
    assert page.console_errors == []


def test_stream_is_coloured_by_source_and_is_the_whole_completion(
        page: Page, api: ServerProcess) -> None:
    page.generate()

    assert page.tab.locator("#out-spec .tok.draft").count() > 0
    assert page.tab.locator("#out-spec .tok.target").count() > 0
    # The playground heals its text prompt (the API does when asked)
    whole = completion(api, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                       token_healing=True)
    assert page.text("#out-spec .tok") == whole["choices"][0]["text"]
    assert page.number("#stat-tokens") == whole["usage"]["completion_tokens"]
    assert page.number("#stat-tps") > 0
    # Draft tokens were accepted (green spans), so both must show it.
    assert 0 < page.number("#stat-acceptance") <= 100
    assert page.number("#stat-mal") > 1
    assert page.console_errors == []
    assert page.hosts == {"127.0.0.1"}


def test_compare_with_cloud_only_sets_both_speeds_side_by_side(
        page: Page, tmp_path: Path) -> None:
    page.tab.check("#compare")
    assert page.tab.is_visible("#panel-cloud")
    page.generate()

    speculative, alone = page.number("#stat-tps"), page.number("#stat-tps-cloud")
    assert alone > 0
    assert page.number("#speedup") == pytest.approx(speculative / alone, rel=0.01, abs=0.01)
    # Lossless: the target alone writes the same text, every token its own.
    assert page.text("#out-cloud .tok.target") == page.text("#out-spec .tok")
    assert page.tab.locator("#out-cloud .tok:not(.target)").count() == 0
    assert page.console_errors == []

    shot = tmp_path / "playground.png"
    page.tab.screenshot(path=str(shot), full_page=True)
    if os.environ.get("SPECECD_SCREENSHOT"):
        keep = Path(os.environ["SPECECD_SCREENSHOT"])
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)


def test_a_json_schema_is_followed_and_its_forced_tokens_have_their_own_colour(
        page: Page, api: ServerProcess) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
        "required": ["name", "size"], "additionalProperties": False}
    page.tab.click("#constraint summary")
    page.tab.fill("#json-schema", json.dumps(schema))
    page.generate()

    # The keys and punctuation the schema fixes are proposed without the draft model.
    assert page.tab.locator("#out-spec .tok.forced").count() > 0
    whole = completion(api, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                       structured_outputs={"json": schema})
    assert page.text("#out-spec .tok") == whole["choices"][0]["text"]
    assert "forced by the schema" in page.tab.text_content("#details")
    assert page.console_errors == []


def test_looked_up_tokens_have_their_own_colour(page: Page) -> None:
    """The default draft source with a draft model is the hybrid: where the text copies
    itself, its drafts are looked up, and shown so."""
    page.tab.fill("#prompt", json.loads((MODELS / "copy_prompts.json").read_text())[7])
    page.generate()

    assert page.tab.locator("#out-spec .tok.lookup").count() > 0
    assert "looked-up drafts accepted" in page.tab.text_content("#details")
    assert page.console_errors == []


def test_a_predicted_output_is_drafted_and_shown_in_its_own_colour(
        page: Page, api: ServerProcess, tmp_path: Path) -> None:
    """The optional predicted output (OpenAI's ``prediction``): the reply the target writes
    alone, with an edit, is drafted from it where the reply follows it, shown in its own
    colour; the text is the target's, and the details count the prediction's tokens."""
    whole = completion(api, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                       token_healing=True)
    text = whole["choices"][0]["text"]
    page.tab.click("#prediction-box summary")
    page.tab.fill("#prediction", text.replace("self", "this", 1))
    page.tab.check("#compare")
    page.generate()

    assert page.tab.locator("#out-spec .tok.prediction").count() > 0
    assert page.text("#out-spec .tok") == text == page.text("#out-cloud .tok")
    details = page.tab.text_content("#details")
    assert "prediction:" in details and "tokens in the reply" in details
    assert page.console_errors == []
    shot = tmp_path / "prediction.png"
    page.tab.screenshot(path=str(shot), full_page=True)
    if os.environ.get("SPECECD_PREDICTION_SCREENSHOT"):
        keep = Path(os.environ["SPECECD_PREDICTION_SCREENSHOT"])
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)


def test_a_bad_request_shows_the_servers_message(page: Page) -> None:
    page.tab.fill("#temperature", "5")
    page.tab.click("#generate")
    page.tab.wait_for_function("document.body.dataset.state === 'error'", timeout=30_000)
    assert page.tab.is_visible("#error")
    assert "temperature" in page.tab.text_content("#error")
    assert page.tab.locator("#out-spec .tok").count() == 0
