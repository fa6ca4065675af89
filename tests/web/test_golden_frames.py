"""The page's codec against Python's, through the golden corpus (tests/web/golden_frames.py):
the committed corpus is what Python encodes now, and the page's own tests (``node --test``
over ``web/test``) read every frame of it as Python does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.web.golden_frames import CORPUS, corpus

WEB = CORPUS.parents[1]


def test_the_committed_corpus_is_what_python_encodes_now() -> None:
    assert CORPUS.read_text() == corpus(), (
        "the server's frames changed: run `python -m tests.web.golden_frames` to rewrite "
        "web/test/frames.json, and make web/src/protocol.js read them (npm test)")


def test_the_page_reads_every_frame_as_python_does() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed (apt-get install nodejs)")
    if not (WEB / "node_modules" / "@msgpack" / "msgpack").is_dir():
        pytest.skip("the page's packages are not installed (cd web && npm ci)")
    result = subprocess.run([node, "--test", str(Path("test"))], cwd=WEB, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# fail 0" in result.stdout and "# pass 0" not in result.stdout
