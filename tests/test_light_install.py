"""A light install: with only the ``llama`` extra (no torch, no transformers) the edge runs
a GGUF draft against a server. A fresh virtual environment gets ``pip install -e
'.[llama]'`` (llama-cpp-python comes from pip's wheel cache once built), and its
``spececd generate`` talks to a verifier server running in this, full, environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import MODELS, REPO, requires_default_pair
from tests.e2e.server import ServerProcess

pytest.importorskip("torch")  # the server side needs the full environment

GGUF_DRAFT = MODELS / "draft.gguf"


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    install = subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "-e", f"{REPO}[llama]"],
        capture_output=True, text=True, timeout=1500, env=clean_env(), check=False)
    assert install.returncode == 0, install.stderr[-3000:]
    return root


def clean_env() -> dict[str, str]:
    """This environment's variables, minus what would let the venv import from elsewhere."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")} | {"OMP_NUM_THREADS": "1"}


def test_the_light_install_has_no_torch_or_transformers(light_venv: Path) -> None:
    for module in ("torch", "transformers"):
        result = subprocess.run([str(light_venv / "bin" / "python"), "-c", f"import {module}"],
                                capture_output=True, text=True, env=clean_env(), check=False)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, module
    # ... while the command line and the API import, and the code is this checkout's
    where = subprocess.run(
        [str(light_venv / "bin" / "python"), "-c",
         "import spececd.cli, spececd.generator, spececd.config; print(spececd.__file__)"],
        capture_output=True, text=True, env=clean_env(), check=False)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(REPO / "src")


@requires_default_pair
@pytest.mark.skipif(not GGUF_DRAFT.is_file(), reason="models/draft.gguf is not there")
def test_gguf_draft_against_a_server_without_torch(
        light_venv: Path, tmp_path: Path, shared_server: Callable[[Path], ServerProcess]) -> None:
    server = shared_server(MODELS / "target")
    result = subprocess.run(
        [str(light_venv / "bin" / "spececd"), "generate", "--draft-model", str(GGUF_DRAFT),
         "--server", server.url, "--prompt", "def f(", "--max-tokens", "8",
         "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=clean_env(),
        check=False)
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    (completion,) = output["completions"]
    assert len(completion["token_ids"]) == 8 and completion["finish_reason"] == "length"
    assert output["stats"]["rounds"] > 0 and output["stats"]["bytes_sent"] > 0
