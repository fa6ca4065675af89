"""An edge with no model and no torch: ``pip install`` with no extra (no torch, no
transformers; the ``tokenizers`` package) runs ``spececd generate --server URL --draft
lookup``. A fresh virtual environment gets ``pip install -e .``; its edge takes the target's
tokenizer from a verifier server running in this, full, environment, rebuilds it with the
``tokenizers`` package alone, and its greedy output is the target's own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import MODELS, REPO, requires_default_pair
from tests.e2e.server import ServerProcess
from tests.test_light_install import clean_env

pytest.importorskip("torch")  # the server side and the reference need the full environment


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    install = subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "-e", str(REPO)],
        capture_output=True, text=True, timeout=900, env=clean_env(), check=False)
    assert install.returncode == 0, install.stderr[-3000:]
    return root


def test_the_bare_install_has_no_torch_transformers_or_model_runtime(bare_venv: Path) -> None:
    for module in ("torch", "transformers", "llama_cpp", "onnxruntime_genai"):
        result = subprocess.run([str(bare_venv / "bin" / "python"), "-c", f"import {module}"],
                                capture_output=True, text=True, env=clean_env(), check=False)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, module


@requires_default_pair
def test_a_lookup_edge_without_torch_gives_the_targets_greedy_output(
        bare_venv: Path, tmp_path: Path, shared_server: Callable[[Path], ServerProcess]) -> None:
    from spececd.backends.registry import load_tokenizer
    from tests.reference import hf_greedy

    prompt = json.loads((MODELS / "copy_prompts.json").read_text())[7]  # copies itself
    server = shared_server(MODELS / "target")
    result = subprocess.run(
        [str(bare_venv / "bin" / "spececd"), "generate", "--server", server.url,
         "--draft", "lookup", "--prompt", prompt, "--max-tokens", "24",
         "--temperature", "0", "--no-token-healing", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**clean_env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}, check=False)
    assert result.returncode == 0, result.stderr
    assert "draft lookup (no draft model)" in result.stderr
    output = json.loads(result.stdout)
    (completion,) = output["completions"]
    tokenizer, _ = load_tokenizer(str(MODELS / "target"))
    ids = tokenizer.encode(prompt)
    assert completion["token_ids"] == hf_greedy(MODELS / "target", ids, 24)[
        :len(completion["token_ids"])]
    assert len(completion["token_ids"]) == 24 or completion["finish_reason"] == "stop"
    assert output["stats"]["lookup_accepted"] > 0  # the lookups were kept, verified
    assert output["stats"]["draft_steps"] == 0  # and no model ever drafted
