"""Shared fixtures: the torch-free toy pair (:mod:`tests.toy`), and tiny random-init
models of real architectures, built here, offline.

Each model folder holds a ``save_pretrained`` model and a byte-level BPE tokenizer trained
on a few standard-library files, so ``AutoModelForCausalLM``/``AutoTokenizer`` load them
like any hub model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.builders import build_model, train_tokenizer, vocab_pair
from tests.e2e.server import ALL_LISTENERS, ServerProcess
from tests.schedule import Recorder, longest_first
from tests.schedule import pytest_configure_node as pytest_configure_node
from tests.schedule import pytest_xdist_make_scheduler as pytest_xdist_make_scheduler
from tests.toy import ToyBackend, toy_pair

# The default suite keeps each promise once per mechanism. These variants repeat one on a
# transport, setting or scale whose code path another variant in the default suite already
# runs (sampling over gRPC and HTTP goes through the same service as over WebSocket; the
# exact-mode variants of each sampling parameter through the same processing as match and
# as the combined variant). They run with `python -m pytest -m slow` (see
# docs/development.md), and keep the default suite within its time on two cores.
SLOW_VARIANTS = frozenset({
    # In process, the websocket variants' loop without the wire (and in-process sampling:
    # tests/e2e/test_sampling_params.py).
    "tests/e2e/test_transports.py::test_sampling_keeps_the_target_distribution"
    "[exact-1.0-0.9-memory]",
    "tests/e2e/test_transports.py::test_sampling_keeps_the_target_distribution"
    "[match-0.8-1.0-memory]",
    "tests/e2e/test_transports.py::test_sampling_keeps_the_target_distribution[exact-1.0-0.9-grpc]",
    "tests/e2e/test_transports.py::test_sampling_keeps_the_target_distribution[exact-1.0-0.9-http]",
    "tests/e2e/test_transports.py::test_sampling_keeps_the_target_distribution[match-0.8-1.0-grpc]",
    "tests/e2e/test_transports.py::test_sampling_keeps_the_target_distribution[match-0.8-1.0-http]",
    "tests/e2e/test_transports.py::test_sampled_token_trees_keep_the_target_distribution"
    "[websocket-exact-1.0-0.9]",
    # Resume after a SIGKILL: websocket-on stays (the edge's link resumes alike over every
    # transport); a stream resumed over a dropped connection stays in test_network.py.
    "tests/e2e/test_transports.py::test_resume_after_the_server_is_killed[websocket-stream]",
    "tests/e2e/test_transports.py::test_resume_after_the_server_is_killed[grpc-stream]",
    "tests/e2e/test_transports.py::test_resume_after_the_server_is_killed[grpc-on]",
    "tests/e2e/test_transports.py::test_resume_after_the_server_is_killed[http-on]",
    "tests/e2e/test_transports.py::test_resume_after_the_server_is_killed[http-stream]",
    "tests/e2e/test_padded_vocab.py::test_sampling_keeps_the_target_distribution"
    "[exact-narrow-draft-memory]",
    "tests/e2e/test_padded_vocab.py::test_sampling_keeps_the_target_distribution"
    "[exact-narrow-draft-websocket]",
    "tests/e2e/test_padded_vocab.py::test_sampling_keeps_the_target_distribution"
    "[exact-wide-draft-memory]",
    "tests/e2e/test_padded_vocab.py::test_sampling_keeps_the_target_distribution"
    "[match-narrow-draft-websocket]",
    "tests/e2e/test_padded_vocab.py::test_sampling_keeps_the_target_distribution"
    "[match-wide-draft-memory]",
    "tests/e2e/test_padded_vocab.py::test_sampling_keeps_the_target_distribution"
    "[match-wide-draft-websocket]",
    # The parameters one by one: the combined variant applies all of them at once (the
    # three penalties, min-p, the logit bias and top-p; assert_distribution checks that
    # leaving any one out changes the target's distribution), and
    # tests/core/test_penalties.py checks each alone against transformers.
    *(f"tests/e2e/test_sampling_params.py::"
      f"test_each_parameter_keeps_the_target_distribution_in_process[{variant}]"
      for variant in ("repetition-exact", "presence-exact", "frequency-exact", "min_p-exact",
                      "logit_bias-exact", "combined-exact", "repetition-match",
                      "presence-match", "frequency-match", "logit_bias-match",
                      "min_p-match")),
    # Constrained sampling on the toy pair: a choice in exact mode and a regex in match mode
    # keep both kinds of grammar and both verifications (and each mode's planted bug,
    # test_a_mask_on_the_drafter_alone_is_caught, stays).
    "tests/e2e/test_constrained.py::"
    "test_sampled_output_is_the_constrained_target_distribution[choice-match]",
    "tests/e2e/test_constrained.py::"
    "test_sampled_output_is_the_constrained_target_distribution[regex-exact]",
    "tests/e2e/test_sampling_params.py::test_combined_parameters_over_the_network",
    "tests/e2e/test_cross_tokenizer.py::test_sampling_keeps_the_target_distribution[websocket]",
    "tests/e2e/test_inprocess.py::test_default_pair_greedy_identical_on_20_heldout_prompts",
    # (the default pair over every transport on 4 prompts: test_transports.py)
    "tests/e2e/test_network.py::test_default_pair_over_the_wire_on_20_heldout_prompts",
    "tests/e2e/test_network.py::test_default_pair_20_concurrent_sessions_identical_to_alone",
    "tests/e2e/test_balancer.py::test_replicas_behind_nginx_lose_no_session[http]",
    "tests/bench/test_bench_cli.py::test_bench_load_reports_a_curve",
    "tests/backends/test_onnx_openvino.py::test_lossless_against_a_server",
    # The exact-mode chi-square with a drafter on another runtime: ONNX Runtime's stays;
    # OpenVINO's drafter samples through the same code from logits the conformance suite
    # checks against transformers.
    "tests/backends/test_onnx_openvino.py::"
    "test_exact_mode_keeps_the_targets_distribution[openvino]",
    # Model-free drafts: tests/edge/test_lookup.py keeps every source and mode, with the
    # planted bug, on the toy pair in seconds, and tests/edge/test_prediction.py the edge's
    # rounds with k auto, whose free rounds draft the prediction (with its planted bug);
    # exact drafts' distributions go over the wire in test_sampling_keeps_the_target_
    # distribution[exact-1.0-0.9-websocket] (a one-hot one is their simplest case).
    "tests/e2e/test_transports.py::test_looked_up_drafts_keep_the_target_distribution"
    "[memory-hybrid-match]",
    "tests/e2e/test_transports.py::test_looked_up_drafts_keep_the_target_distribution"
    "[memory-lookup-exact]",
    "tests/e2e/test_transports.py::test_looked_up_drafts_keep_the_target_distribution"
    "[websocket-hybrid-exact]",
    # Match verification of sampled drafts: tests/core/test_verify.py (with its planted
    # bugs) and test_sampling_params.py's match variants; exact mode stays over the wire.
    "tests/e2e/test_transports.py::test_sampling_keeps_the_target_distribution"
    "[match-0.8-1.0-websocket]",
    "tests/e2e/test_padded_vocab.py::test_sampling_keeps_the_target_distribution"
    "[match-narrow-draft-memory]",
    # Trees in match mode: tests/core/test_tree_verify.py checks both modes; exact trees
    # (siblings drawn without replacement) stay end to end.
    "tests/e2e/test_transports.py::test_sampled_token_trees_keep_the_target_distribution"
    "[memory-match-0.8-1.0]",
    # Fuzzing every transport's live server: tests/transports/test_http.py and test_grpc.py
    # fuzz those two each; the end-to-end run over WebSocket and in process stays.
    "tests/e2e/test_transports.py::test_fuzzing_leaves_legitimate_sessions_unchanged"
    "[http-1000]",
    "tests/e2e/test_transports.py::test_fuzzing_leaves_legitimate_sessions_unchanged"
    "[grpc-1000]",
    # bfloat16: match verification is the same for any dtype's probabilities; exact stays.
    "tests/e2e/test_bfloat16.py::"
    "test_sampling_in_bfloat16_keeps_the_targets_bfloat16_distribution[match]",
    # A bench SIGKILLed as its first child starts: the child then dies with the bench's
    # pipe anyway; the one killed with its server and worker running stays.
    "tests/test_processes.py::test_a_sigkilled_bench_leaves_no_process[starting]",
})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--static-path", action="store_true",
                     help="serve every transformers target in the built-in runner's fixed "
                     "shapes (spececd.backends.paged), as on CUDA, to check that its output "
                     "is the target's: in process and in `spececd serve` subprocesses")
    parser.addoption("--store-durations", action="store_true",
                     help="record each test file's seconds in tests/durations.json, the "
                     "order in which xdist's workers take the files (tests/schedule.py)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--store-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Recorder(), "store-durations")
    if config.getoption("--static-path"):
        from spececd.cloud import builtin

        chosen = builtin.runner_path

        def runner_path(backend: Any, config: Any, max_context: int) -> Any:
            on = config.static == "auto" and backend.name == "hf"  # a transformers target's
            return chosen(backend, replace(config, static="on") if on else config, max_context)

        builtin.runner_path = runner_path  # type: ignore[assignment]
        from tests.e2e.server import STATIC_ENV

        os.environ[STATIC_ENV] = "1"  # servers started as subprocesses (ServerProcess)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_first(config, items)
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)


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
def shared_server() -> Iterator[Callable[[Path], ServerProcess]]:
    """``shared_server(target)``: ``spececd serve`` for ``target`` with a listener for every
    transport, one for all the test files this worker runs that ask for ``target``: started
    at the first ask, stopped as the session ends (a start costs 6-8 s here). For tests
    that neither stop nor reconfigure it, and read its counters as differences."""
    running: dict[Path, ServerProcess] = {}

    def get(target: Path) -> ServerProcess:
        if target not in running or not running[target].alive():  # (one that failed: anew)
            running[target] = ServerProcess(target, *ALL_LISTENERS)
        return running[target]

    yield get
    for proc in running.values():
        proc.stop()


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
