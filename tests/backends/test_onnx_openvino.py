"""The ONNX Runtime GenAI and OpenVINO backends (the NPU runtimes), on the CPU: conversion
with ``spececd convert`` (the conformance suite against transformers runs them in
tests/backends/test_conformance.py), rollback, lossless
generation as the drafter (greedy identity and chi-square in exact mode, in-process and
against a server), quantized drafts, ``--device npu``'s fallback and ``spececd devices``.

Tolerance against transformers (same weights, fp32 exports): max |Δlogit| <= 1e-4 (≈1e-5
measured here for both runtimes on the tiny models and the default draft).

No NPU is reachable here: the NPU paths themselves (QNN, OpenVINO's NPU plugin) are not run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime_genai", reason="pip install 'spececd[onnx]' runs these tests")
pytest.importorskip("openvino", reason="pip install 'spececd[openvino]' runs these tests")

from spececd.backends import openvino  # noqa: E402
from spececd.backends.base import tokenizer_fingerprint  # noqa: E402
from spececd.backends.devices import has_npu  # noqa: E402
from spececd.backends.registry import load_backend, model_format  # noqa: E402
from spececd.cli import main  # noqa: E402
from spececd.errors import InputError  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from tests.backends.conftest import Converted  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.chisq import first_token_p_value  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tests.reference import PROMPTS, hf_greedy  # noqa: E402
from tests.support.conformance import transformers_fresh, worst_difference  # noqa: E402

FORMATS = ["onnx", "openvino"]
TOLERANCE = 1e-4


def export(fmt: str, model: Path, out: Path, quant: str = "fp32") -> Path:
    """``spececd convert --to FMT`` through the command line."""
    assert main(["convert", "--to", fmt, "--quant", quant, str(model), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def exported(converted: Converted) -> dict[tuple[str, str], Path]:
    return {(fmt, name): converted(fmt, name) for fmt in FORMATS for name in ("llama", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_converted_model_is_its_transformers_model(fmt: str, arch: str,
                                                     exported: dict[tuple[str, str], Path],
                                                     tiny_models: dict[str, Path]) -> None:
    """Recognised by its folder, with the tokenizer, sizes and float32 logits of the
    model it came from (that its logits are the same is the conformance suite's)."""
    folder = exported[(fmt, arch)]
    assert model_format(str(folder)) == fmt
    backend = load_backend(str(folder), device="cpu")
    assert backend.name == fmt
    assert backend.new_sequence().extend([1, 2, 3]).dtype == np.float32
    reference = load_backend(str(tiny_models[arch]), device="cpu", dtype="float32")
    assert tokenizer_fingerprint(backend.tokenizer, backend.vocab_size) == \
        tokenizer_fingerprint(reference.tokenizer, reference.vocab_size)
    assert backend.tokenizer.eos_token_ids == reference.tokenizer.eos_token_ids
    assert backend.kv_bytes_per_token == reference.kv_bytes_per_token  # float32 both
    assert backend.max_context == reference.max_context


@pytest.mark.parametrize("fmt", FORMATS)
def test_chains_only(fmt: str, exported: dict[tuple[str, str], Path]) -> None:
    backend = load_backend(str(exported[(fmt, "qwen2")]), device="cpu")
    assert not backend.tree_attention
    seq = backend.new_sequence()
    with pytest.raises(ValueError, match="chains only"):
        seq.extend([1, 2, 3], parents=[-1, -1, 0])
    seq.extend([1, 2, 3, 4])
    seq.select(2, [2])  # a contiguous run is a truncate
    assert seq.tokens == [1, 2, 3]
    with pytest.raises(ValueError, match="contiguous"):
        seq.select(1, [3])
    with pytest.raises(ValueError, match="exceed the context"):
        seq.extend([1] * backend.max_context)
    seq.truncate(0)
    assert seq.extend([1] * backend.max_context, keep=1).shape == (1, backend.vocab_size)


@pytest.mark.parametrize("tree_width", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_output_is_the_targets_with_this_drafter(
        fmt: str, tree_width: int, exported: dict[tuple[str, str], Path],
        tiny_models: dict[str, Path]) -> None:
    # token trees too: the drafter branches from its distributions along one chain
    with Generator.load(str(exported[(fmt, "qwen2")]), str(tiny_models["llama"]),
                        device="cpu", k=3, tree_width=tree_width) as gen:
        assert gen.draft_backend.name == fmt
        siblings = 0
        for prompt in PROMPTS[:3]:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=24, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 24)
            assert out.stats.drafted > 0
            siblings += out.stats.tree_siblings
    assert (siblings > 0) == (tree_width > 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_mode_keeps_the_targets_distribution(
        fmt: str, exported: dict[tuple[str, str], Path], tiny_models: dict[str, Path]) -> None:
    # the draft is the target's own weights: its proposals are accepted, so the test sees
    # the acceptance rule at work, not only the target's corrections
    with Generator.load(str(exported[(fmt, "llama")]), str(tiny_models["llama"]),
                        device="cpu", mode="exact", k=1) as gen:
        p_value = first_token_p_value(gen, tiny_models["llama"], 2000)
    print(f"{fmt} drafter in-process, exact mode: chi-square p={p_value:.4f}")
    assert p_value > 0.001


def test_lossless_against_a_server(exported: dict[tuple[str, str], Path],
                                   tiny_models: dict[str, Path],
                                   shared_server: Callable[[Path], ServerProcess]) -> None:
    proc = shared_server(tiny_models["llama"])
    p_values = {}
    for fmt in FORMATS:
        with Generator.load(str(exported[(fmt, "qwen2")]), server=proc.url, device="cpu",
                            mode="exact", k=3, proactive="off") as gen:
            ids = gen.prompt_ids(PROMPTS[2])
            out = gen.generate(ids, max_tokens=20, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 20), fmt
            p_values[fmt] = first_token_p_value(gen, tiny_models["llama"], 1500)
    print(f"drafters over the network, exact mode: chi-square p={p_values}")
    assert min(p_values.values()) > 0.001


@pytest.mark.parametrize(("fmt", "quant"), [("onnx", "int4"), ("openvino", "int8")])
def test_a_quantized_draft_stays_lossless(fmt: str, quant: str, tiny_models: dict[str, Path],
                                          tmp_path: Path) -> None:
    folder = export(fmt, tiny_models["llama"], tmp_path / quant, quant)
    worst = float(np.abs(load_backend(str(folder)).new_sequence().extend(list(range(20)))
                         - transformers_fresh(tiny_models["llama"])(list(range(20)))).max())
    print(f"{fmt} {quant}: max |logit difference| from transformers {worst:.2e}")
    assert worst > TOLERANCE  # the weights did change
    with Generator.load(str(folder), str(tiny_models["llama"]), device="cpu", k=4) as gen:
        ids = gen.prompt_ids(PROMPTS[0])
        out = gen.generate(ids, max_tokens=24, temperature=0, stop_token_ids=[])
        assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 24)
        assert out.stats.accepted > 0


@requires_default_pair
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_default_draft_converts_and_pairs_with_the_default_target(fmt: str,
                                                                     tmp_path: Path) -> None:
    folder = export(fmt, MODELS / "draft", tmp_path / fmt)
    backend = load_backend(str(folder))
    worst = worst_difference(backend, transformers_fresh(MODELS / "draft"), seed=5, steps=12,
                             size=100)
    print(f"{fmt} default draft: max |logit difference| from transformers {worst:.2e}")
    assert worst <= TOLERANCE
    with Generator.load(str(folder), str(MODELS / "target"), device="cpu", dtype="float32",
                        k="auto") as gen:
        ids = gen.prompt_ids(PROMPTS[0])
        out = gen.generate(ids, max_tokens=32, temperature=0, stop_token_ids=[])
        assert out.token_ids == hf_greedy(MODELS / "target", ids, 32)
        assert out.stats.accepted > 0


@pytest.mark.parametrize("fmt", [*FORMATS, "hf"])
def test_device_npu_falls_back_to_the_cpu_with_one_notice(
        fmt: str, exported: dict[tuple[str, str], Path], tiny_models: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    if fmt != "hf" and has_npu(fmt):
        pytest.skip("this machine has an NPU: there is no fallback to observe")
    folder = tiny_models["draft"] if fmt == "hf" else exported[(fmt, "qwen2")]
    with caplog.at_level(logging.WARNING, logger="spececd.backends.registry"):
        backend = load_backend(str(folder), device="npu", dtype="float32")
    notices = [r.message for r in caplog.records if "npu" in r.message]
    assert len(notices) == 1 and "running on cpu" in notices[0], notices
    assert "cpu" in backend.description.lower() or fmt == "hf"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spececd.backends.registry"):
        load_backend(str(folder), device="npu", dtype="float32", npu=False)
    assert any("turned off (npu = false)" in r.message for r in caplog.records)


def test_bad_conversions_say_what_to_do(tiny_models: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in [
            (["--to", "onnx", "--quant", "q4_k_m", str(tiny_models["draft"])], "int8, int4"),
            (["--to", "openvino", "--weight-format", "int2", str(tiny_models["draft"])],
             "--weight-format takes"),
            (["--to", "openvino", str(tmp_path)], "no config.json"),
            (["--to", "onnx", str(tiny_models["draft"])], "needs a multiple of 16")]:
        assert main(["convert", *args, str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err


def test_folders_a_backend_cannot_draft_with_are_refused(
        exported: dict[tuple[str, str], Path], tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    import json
    import shutil

    pipeline = Path(shutil.copytree(exported[("onnx", "qwen2")], tmp_path / "pipeline"))
    config = json.loads((pipeline / "genai_config.json").read_text())
    config["model"]["type"] = "decoder-pipeline"
    (pipeline / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="cannot rewind"):
        load_backend(str(pipeline))
    with pytest.raises(InputError, match="has no device 'gpu'"):
        load_backend(str(exported[("openvino", "qwen2")]), device="gpu")
    from transformers import AutoConfig

    dynamic = Path(shutil.copytree(tiny_models["llama"], tmp_path / "dynamic"))
    settings = AutoConfig.from_pretrained(dynamic)
    settings.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    settings.save_pretrained(dynamic)
    with pytest.raises(InputError, match="'dynamic' rotary embeddings"):
        openvino.export(dynamic, tmp_path / "out")


def test_devices_lists_both_runtimes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.split()[:2] == ["cpu", "onnx"] for line in lines), out
    assert any(line.split()[:2] == ["cpu", "openvino"] for line in lines), out
    assert "--device npu" in out
    with pytest.raises(SystemExit) as done:
        main(["--list-devices"])
    assert done.value.code == 0 and capsys.readouterr().out == out
