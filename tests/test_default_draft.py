"""The default draft: the rule that runs its fastest form this machine can run
(``spececd.cli.options.choose_draft``), the ONNX Runtime GenAI form models/ ships (rebuilt
byte for byte by the command models/README.md gives), and greedy output with the chosen
draft, loaded the way the demo loads it, equal to the target alone's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from spececd.cli import options
from spececd.cli.options import Draft, choose_draft
from tests.builders import MODELS, requires_default_pair


def models_folder(root: Path, forms: set[str]) -> Path:
    """A models/ folder holding the default draft in ``forms``: files that name each form
    (the rule looks at names and marker files only; nothing here is loaded)."""
    (root / "draft").mkdir()
    (root / "draft" / "config.json").write_text("{}")
    if "draft.gguf" in forms:
        (root / "draft.gguf").write_bytes(b"GGUF")
    if "draft-onnx" in forms:
        (root / "draft-onnx").mkdir()
        (root / "draft-onnx" / "genai_config.json").write_text("{}")
    return root


@pytest.mark.parametrize(("forms", "installed", "chosen", "backend", "faster"), [
    ({"draft-onnx", "draft.gguf"}, {"onnx", "llama.cpp", "hf"}, "draft-onnx", "onnx", ""),
    ({"draft-onnx", "draft.gguf"}, {"llama.cpp", "hf"}, "draft.gguf", "llama.cpp", "onnx"),
    ({"draft-onnx", "draft.gguf"}, {"hf"}, "draft", "hf", "onnx"),
    ({"draft.gguf"}, {"onnx", "hf"}, "draft", "hf", "llama.cpp"),
    ({"draft.gguf"}, {"onnx", "llama.cpp", "hf"}, "draft.gguf", "llama.cpp", ""),
    (set(), {"onnx", "llama.cpp", "hf"}, "draft", "hf", ""),
])
def test_the_default_draft_is_its_fastest_form_whose_runtime_is_installed(
        forms: set[str], installed: set[str], chosen: str, backend: str, faster: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECECD_MODELS", str(models_folder(tmp_path, forms)))
    monkeypatch.setattr(options, "installed", lambda name: name in installed)
    assert choose_draft(None) == Draft(str(tmp_path / chosen), backend, faster)
    assert choose_draft(None, "cpu") == choose_draft(None)


@pytest.mark.parametrize("device", ["cuda", "mps", "npu"])
def test_on_another_device_than_the_cpu_the_default_draft_is_transformers(
        device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the faster forms are CPU builds: draft-onnx would ask a CPU-only ONNX Runtime for
    # CUDA and fail to load
    monkeypatch.setenv("SPECECD_MODELS", str(models_folder(tmp_path, {"draft-onnx",
                                                                      "draft.gguf"})))
    monkeypatch.setattr(options, "installed", lambda name: True)
    assert choose_draft(None, device) == Draft(str(tmp_path / "draft"), "hf")


def test_what_the_first_line_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert str(Draft(str(tmp_path / "models" / "draft-onnx"), "onnx")) == \
        "models/draft-onnx (ONNX Runtime GenAI)"
    assert str(Draft("/elsewhere/draft.gguf", "llama.cpp")) == "/elsewhere/draft.gguf (llama.cpp)"
    assert str(Draft(str(tmp_path / "draft"), "hf", faster="onnx")) == (
        "draft (transformers; pip install 'spececd[onnx]' to draft with its faster ONNX "
        "Runtime GenAI form)")


def test_a_named_draft_is_taken_as_given(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECECD_MODELS", str(models_folder(tmp_path, {"draft-onnx"})))
    monkeypatch.setattr(options, "installed", lambda name: True)
    assert choose_draft(str(tmp_path / "draft")) == Draft(str(tmp_path / "draft"), "hf")
    assert choose_draft("org/model") == Draft("org/model", "hf")
    assert choose_draft("x.gguf") == Draft("x.gguf", "llama.cpp")


SHIPPED_ONNX = MODELS / "draft-onnx"


def digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.iterdir()}


@requires_default_pair
@pytest.mark.slow  # the builder takes about 10 s here
@pytest.mark.skipif(not SHIPPED_ONNX.is_dir(), reason="models/draft-onnx is not there")
def test_the_shipped_onnx_draft_is_what_its_command_builds(tmp_path: Path) -> None:
    for module in ("torch", "onnxruntime_genai", "onnx", "onnx_ir"):
        pytest.importorskip(module)
    from spececd.cli import main

    # models/README.md: spececd convert --to onnx --quant int8 models/draft models/draft-onnx
    assert main(["convert", "--to", "onnx", "--quant", "int8", str(MODELS / "draft"),
                 str(tmp_path / "draft-onnx")]) == 0
    assert digests(tmp_path / "draft-onnx") == digests(SHIPPED_ONNX)


@requires_default_pair
def test_the_chosen_default_draft_gives_the_targets_greedy_output() -> None:
    """Whatever form runs here, loaded as the demo loads it: the target's tokens, the
    target tokenizer's text, and no drafting across two tokenizers."""
    pytest.importorskip("torch")
    from spececd.backends.base import tokenizer_fingerprint
    from spececd.config import EdgeConfig
    from tests.reference import hf_greedy

    draft = choose_draft(None)
    print(f"the default draft here: {draft}")
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())[:3]
    with options.load_generator(EdgeConfig(device="cpu", dtype="float32"), draft) as gen:
        assert gen.draft_backend.name == draft.backend and not gen.cross
        target = gen.target_backend
        assert target is not None
        assert tokenizer_fingerprint(gen.draft_backend.tokenizer, gen.draft_backend.vocab_size) \
            == tokenizer_fingerprint(target.tokenizer, target.vocab_size)
        for prompt in prompts:
            ids = gen.prompt_ids(prompt)
            assert ids == target.tokenizer.encode(prompt)
            out = gen.generate(prompt, max_tokens=32, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(MODELS / "target", ids, 32), prompt
            assert out.text == target.tokenizer.decode(out.token_ids)
