"""Shared fixtures: the torch-free toy pair (:mod:`tests.toy`), and tiny random-init
models of real architectures, built here, offline.

Each model folder holds a ``save_pretrained`` model and a byte-level BPE tokenizer trained
on a few standard-library files, so ``AutoModelForCausalLM``/``AutoTokenizer`` load them
like any hub model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.builders import build_model, train_tokenizer, vocab_pair
from tests.toy import ToyBackend, toy_pair


@pytest.fixture()
def toy() -> tuple[ToyBackend, ToyBackend]:
    """A fresh toy (draft, target) pair, the draft agreeing with the target at 70% of
    contexts (numpy only; each test gets its own, so ``calls`` counts its own feeds)."""
    return toy_pair(agreement=0.7)


def needs_hf() -> None:
    """Skip a test whose models are built with torch and transformers where they are not
    installed (the toy pair needs neither)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    needs_hf()
    return train_tokenizer(512)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> dict[str, Path]:
    """Tiny random-init Llama, Qwen2 and GPT-2 folders, plus a Llama draft/target pair."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": build_model("llama", root / "llama", tokenizer, seed=0),
        "qwen2": build_model("qwen2", root / "qwen2", tokenizer, seed=1),
        "gpt2": build_model("gpt2", root / "gpt2", tokenizer, seed=2),
        "draft": build_model("llama", root / "draft", tokenizer, seed=3, layers=1, hidden=32),
    }


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]) -> Any:
    """The tiny Llama, loaded by the transformers backend (CPU, float32)."""
    from spececd.backends.registry import load_backend

    return load_backend(str(tiny_models["llama"]), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def draft(tiny_models: dict[str, Path]) -> Any:
    """The tiny Llama draft, loaded by the transformers backend (CPU, float32)."""
    from spececd.backends.registry import load_backend

    return load_backend(str(tiny_models["draft"]), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def other_tokenizer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose tokenizer differs from the others: another size, and merges
    learnt from other files."""
    needs_hf()
    root = tmp_path_factory.mktemp("other")
    other = train_tokenizer(400, files=("heapq.py", "fnmatch.py", "csv.py"))
    return build_model("llama", root / "llama", other, seed=4)


@pytest.fixture(scope="session")
def tiny_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A draft and a target over a 10-word vocabulary, for exact distribution tests."""
    needs_hf()
    return vocab_pair(tmp_path_factory.mktemp("tinyvocab"))
