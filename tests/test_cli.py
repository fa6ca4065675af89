"""The command line: JSON output, streaming, the demo, devices, and one-line errors with
exit status 2 for every bad input."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from spececd.cli import main
from spececd.generator import Generator


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def pair(tiny_models: dict[str, Path]) -> list[str]:
    return ["--draft-model", str(tiny_models["draft"]), "--target-model",
            str(tiny_models["llama"]), "--device", "cpu"]


def test_generate_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str],
                                                 pair: list[str],
                                                 tiny_models: dict[str, Path]) -> None:
    code, out, _ = run(capsys, "generate", *pair, "--prompt", "def f(x):", "--max-tokens", "12",
                       "--temperature", "0", "--json", "--k", "3")
    assert code == 0
    result = json.loads(out)
    (completion,) = result["completions"]
    assert set(completion) >= {"token_ids", "text"} and len(completion["token_ids"]) <= 12
    for key in ("drafted", "accepted", "rounds", "acceptance_rate", "mean_accepted_len",
                "tokens_per_s", "wall_s"):
        assert key in result["stats"]
    gen = Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu")
    assert completion["token_ids"] == gen.generate("def f(x):", max_tokens=12,
                                                   temperature=0).token_ids


def test_generate_json_carries_logprobs_when_asked(capsys: pytest.CaptureFixture[str],
                                                  pair: list[str]) -> None:
    code, out, _ = run(capsys, "generate", *pair, "--prompt", "def f(x):", "--max-tokens", "5",
                       "--temperature", "0", "--json", "--logprobs", "2")
    assert code == 0
    (completion,) = json.loads(out)["completions"]
    entries = completion["logprobs"]
    assert [e["token_id"] for e in entries] == completion["token_ids"]
    for entry in entries:  # greedy, raw: the chosen token is the likeliest
        assert len(entry["top"]) == 2 and entry["top"][0] == [entry["token_id"], entry["logprob"]]


def test_generate_n_draws_independent_completions(capsys: pytest.CaptureFixture[str],
                                                  pair: list[str]) -> None:
    code, out, _ = run(capsys, "generate", *pair, "--prompt-ids", "5,6,7", "--max-tokens", "6",
                       "--n", "4", "--seed", "3", "--top-k", "20", "--top-p", "0.9", "--json",
                       "--mode", "match")
    assert code == 0
    completions = json.loads(out)["completions"]
    assert len(completions) == 4 and len({tuple(c["token_ids"]) for c in completions}) > 1


def test_generate_streams_text_and_a_summary(capsys: pytest.CaptureFixture[str],
                                             pair: list[str]) -> None:
    code, out, err = run(capsys, "generate", *pair, "--prompt", "import os", "--max-tokens", "8",
                         "--seed", "1", "--color", "never")
    assert code == 0 and "\033[" not in out
    assert "tokens/s" in err and "acceptance" in err and "mean accepted length" in err
    assert err.splitlines()[0] == (f"spececd: draft {pair[1]} (transformers) · target in "
                                   "float32, the model's own")


def test_chat_names_its_draft_first(capsys: pytest.CaptureFixture[str], pair: list[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f():\n\n"))
    code, out, err = run(capsys, "chat", *pair, "--max-tokens", "4", "--color", "never")
    assert code == 0 and out.startswith("assistant> ")
    assert err.splitlines()[0] == (f"spececd: draft {pair[1]} (transformers) · target in "
                                   "float32, the model's own")


def test_threshold_mode_is_labelled_lossy(capsys: pytest.CaptureFixture[str],
                                         pair: list[str]) -> None:
    lossy = [*pair, "--prompt", "import os", "--max-tokens", "8", "--seed", "1",
             "--mode", "threshold", "--threshold", "0.2"]
    code, out, err = run(capsys, "generate", *lossy, "--json")
    assert code == 0 and json.loads(out)["stats"]["lossy"] is True
    code, out, err = run(capsys, "generate", *lossy, "--color", "never")
    assert code == 0 and "LOSSY threshold mode" in err
    code, out, err = run(capsys, "generate", *pair, "--prompt", "import os", "--max-tokens",
                         "8", "--color", "never")
    assert code == 0 and "LOSSY" not in err


@pytest.fixture()
def bad_cases(tiny_models: dict[str, Path], tmp_path: Path) -> dict[str, list[str]]:
    draft, target = str(tiny_models["draft"]), str(tiny_models["llama"])
    ok = ["--draft-model", draft, "--target-model", target, "--device", "cpu"]
    return {
        "unknown model path": ["--draft-model", str(tmp_path / "nope"), "--target-model", target,
                               "--prompt", "x"],
        "negative temperature": [*ok, "--prompt", "x", "--temperature", "-0.5"],
        "top-p above 1": [*ok, "--prompt", "x", "--top-p", "1.5"],
        "top-p zero": [*ok, "--prompt", "x", "--top-p", "0"],
        "k below 1": [*ok, "--prompt", "x", "--k", "0"],
        "empty prompt": [*ok, "--prompt", ""],
        "empty prompt file": [*ok, "--prompt-file", os.devnull],
        "prompt longer than the context": [*ok, "--prompt-ids", ",".join(["5"] * 300)],
        "out-of-vocabulary ids": [*ok, "--prompt-ids", "1,2,100000"],
        "malformed ids": [*ok, "--prompt-ids", "1,two,3"],
        "threshold mode without a threshold": [*ok, "--prompt", "x", "--mode", "threshold"],
        "repetition penalty zero": [*ok, "--prompt", "x", "--repetition-penalty", "0"],
        "presence penalty above 2": [*ok, "--prompt", "x", "--presence-penalty", "3"],
        "min-p above 1": [*ok, "--prompt", "x", "--min-p", "1.5"],
        "malformed logit bias": [*ok, "--prompt", "x", "--logit-bias", "5:x"],
        "logit bias outside the vocabulary": [*ok, "--prompt", "x", "--logit-bias", "99999:1"],
        "a threshold above 1": [*ok, "--prompt", "x", "--mode", "threshold",
                                "--threshold", "1.5"],
        "logprobs without json": [*ok, "--prompt", "x", "--logprobs", "2"],
        "logprobs above 20": [*ok, "--prompt", "x", "--logprobs", "21", "--json"],
    }


@pytest.mark.parametrize("case", [
    "unknown model path", "negative temperature", "top-p above 1",
    "top-p zero", "k below 1", "empty prompt", "empty prompt file",
    "prompt longer than the context", "out-of-vocabulary ids", "malformed ids",
    "threshold mode without a threshold", "a threshold above 1", "repetition penalty zero",
    "presence penalty above 2", "min-p above 1", "malformed logit bias",
    "logit bias outside the vocabulary", "logprobs without json", "logprobs above 20"])
def test_bad_input_is_one_line_and_exit_2(case: str, bad_cases: dict[str, list[str]],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "generate", *bad_cases[case])
    assert code == 2, err
    lines = err.strip().splitlines()
    if lines[0].startswith("spececd: draft "):  # said before the models load
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("spececd: error: "), err
    assert "Traceback" not in err and out == ""


def test_devices_lists_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "devices", "--json")
    assert code == 0 and any(d["device"] == "cpu" for d in json.loads(out))


def test_demo_runs_on_a_models_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                      tiny_models: dict[str, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(tiny_models["draft"], tmp_path / "draft")
    shutil.copytree(tiny_models["llama"], tmp_path / "target")
    (tmp_path / "heldout_prompts.json").write_text(json.dumps(["def a():\n", "class B:\n"]))
    monkeypatch.setenv("SPECECD_MODELS", str(tmp_path))
    code, out, _ = run(capsys, "demo", "--device", "cpu", "--max-tokens", "10",
                       "--color", "always")
    assert code == 0
    # the default draft in the form this folder has: transformers' alone
    assert out.splitlines()[0] == (f"SpecECD demo: draft {tmp_path / 'draft'} (transformers) · "
                                   "target in float32, the model's own")
    # Per prompt and overall: SpecECD beside the target alone, measured in this run, and
    # (greedy by default) the target alone's very tokens.
    compared = [line for line in out.splitlines() if re.fullmatch(
        r"(--- |all prompts: )SpecECD [\d.]+ tokens/s · target alone [\d.]+ tokens/s · "
        r"[\d.]+x( · the same tokens)?", line)]
    assert len(compared) == 3 and out.count(" · the same tokens") == 2
    assert out.count("acceptance ") == 3  # each with its statistics
    assert "\033[32m" in out or "\033[1;33m" in out


def test_module_and_console_script_run() -> None:
    result = subprocess.run([sys.executable, "-m", "spececd", "--help"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0 and "generate" in result.stdout
    script = shutil.which("spececd")
    assert script is not None
    result = subprocess.run([script, "generate", "--help"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0 and "--max-tokens" in result.stdout


@pytest.mark.parametrize("args,said", [
    (["serve", "--engine", "vllm", "--engine-args", "[1]"], "must be a JSON object"),
    (["bench", "load", "--engine", "tgi"], "--engine takes builtin, vllm"),
    (["bench", "load", "--kind", "vllm-spec"], "vllm-spec is a vLLM row"),
    (["bench", "load", "--kind", "replay-fast"], "--kind takes"),
])
def test_bad_engine_and_load_options_are_one_line(
        args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spececd: error: "), err
    assert said in lines[0] and out == ""


def test_api_refuses_an_unknown_tool_call_parser_before_loading(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[edge]\ntool_call_parser = "mistral"\n')
    code, out, err = run(capsys, "api", "--config", str(config), "--draft-model",
                         str(tmp_path / "never-loaded"))
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines() == [
        "spececd: error: unknown tool-call parser 'mistral': choose one of hermes, "
        "llama3_json"]


def test_serve_checks_the_engine_before_it_says_serving(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tiny_models: dict[str, Path]) -> None:
    """A target that loads but cannot run (every pass fails) exits with status 1 and the
    cause, and never prints "serving"."""
    from spececd.backends import registry
    from spececd.backends.registry import load_backend
    from tests.cloud.test_service import FailingBackend

    def broken(*args: object, **kw: object) -> FailingBackend:
        backend = load_backend(*args, **kw)  # type: ignore[arg-type]
        prompt = backend.tokenizer.encode("Hello")[:4] or [0]
        return FailingBackend(backend, prompt[0])

    monkeypatch.setattr(registry, "load_backend", broken)
    code, _, err = run(capsys, "serve", "--target-model", str(tiny_models["llama"]),
                       "--device", "cpu", "--port", "0")
    assert code == 1
    assert "serving" not in err
    assert "device lost" in err and "engine cannot generate" in err


def test_thread_defaults_leave_the_other_side_a_core(tmp_path: Path) -> None:
    """On transformers: a draft beside a remote verifier runs on one torch thread, an
    in-process pair and a server on all cores but one; --threads wins; other runtimes keep
    their own choice (0). Two processes on one machine then never have more OpenMP threads
    than cores between them."""
    from spececd.cli.options import edge_threads, spare_cores
    from spececd.config import EdgeConfig

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    assert spare_cores() == max(1, cores - 1)
    hf, gguf = str(tmp_path / "draft"), str(tmp_path / "draft.gguf")
    assert edge_threads(EdgeConfig(server="ws://x:1"), hf) == 1
    assert edge_threads(EdgeConfig(target_model=hf), hf) == spare_cores()
    assert edge_threads(EdgeConfig(server="ws://x:1", threads=3), hf) == 3
    assert edge_threads(EdgeConfig(server="ws://x:1"), gguf) == 0
    # The target's count is the draft's too: given only where it is one thread.
    assert edge_threads(EdgeConfig(target_model=hf), gguf) == (1 if cores <= 2 else 0)
    assert edge_threads(EdgeConfig(target_model=gguf), hf) == 0


def test_the_command_lines_process_loads_a_model_without_scikit_learn_or_scipy() -> None:
    """transformers imports SciPy with its modeling utilities (for its object-detection
    losses), and before 5.21 scikit-learn (SciPy, pandas) with its generation utilities:
    features no command uses in its own process, 0.7 s and 1.8 s of every command's start.
    Where the environment has them, a command loads a model without them."""
    pytest.importorskip("transformers")
    installed = [name for name in ("sklearn", "scipy") if importlib.util.find_spec(name)]
    if not installed:
        pytest.skip("neither scikit-learn nor SciPy is installed here")
    names = (*installed, "transformers.generation.utils", "transformers.modeling_utils")
    code = ("import sys; from spececd.backends.startup import skip_unused_imports; "
            "skip_unused_imports(); from spececd.backends import hf; "
            "from transformers import LlamaForCausalLM; "
            f"print(*(name in sys.modules for name in {names!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    # the generation and modeling utilities loaded, scikit-learn and SciPy did not
    assert out == ["False"] * len(installed) + ["True", "True"]


def test_the_command_ends_its_process_without_the_interpreters_teardown() -> None:
    """``spececd`` and ``python -m spececd`` exit through ``processes.exit_now``: the exit
    handlers run and what was printed is flushed, with the command's exit code, but the
    teardown of the loaded modules (about a second with torch and transformers) is skipped:
    an object left in a module is never finalized. Without it, the teardown runs, and the
    object says so. Output that cannot be written (stdout on a full disk) makes a command
    that succeeded exit with 120, as an ordinary exit does, and says so."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "spececd"]
    assert script.value == "spececd.cli:command"
    program = textwrap.dedent("""
        import atexit, runpy, sys
        class Left:
            def __del__(self):
                print("torn down", flush=True)
        left = Left()
        atexit.register(lambda: print("exit handler", end=" "))
        sys.argv = ["spececd", *sys.argv[1:]]
        print("from the command:", end=" ")
        runpy.run_module("spececd", run_name="__main__")  # python -m spececd
        """)

    def command(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", program, *argv], capture_output=True,
                              text=True, timeout=120, check=False)

    failed = command("convert", "/nowhere", "out.gguf")  # the command's own exit code: 2
    assert failed.returncode == 2, failed.stderr
    assert failed.stdout == "from the command: exit handler "  # flushed, and no teardown
    assert "/nowhere is not a transformers model folder" in failed.stderr
    listed = command("devices")
    assert listed.returncode == 0 and listed.stdout.startswith("from the command: device")
    assert "torn down" not in listed.stdout
    if Path("/dev/full").exists():  # Linux: every write fails with ENOSPC
        buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        with open("/dev/full", "w") as full:
            lost = subprocess.run([sys.executable, "-m", "spececd", "devices"], stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=120,
                                  env=buffered, check=False)
        assert lost.returncode == 120, lost.stderr
        assert "could not write its output" in lost.stderr
