"""Backend conformance: after any sequence of extend/truncate calls, ``extend`` returns the
logits a fresh forward pass over the same tokens gives.

Runs over the torch-free toy backend (:mod:`tests.toy`, whose fresh pass is its slow
reference ``ToyModel.forward``) and, where torch is installed, the transformers backend on
tiny Llama, Qwen2 and GPT-2 models, and the built-in runner's packed, paged path
(:mod:`spececd.backends.paged`: pages of one pool, rows packed in one forward) on the same
models, as off CUDA and on the fixed shapes of CUDA graphs (``-fixed``), eagerly; and the
other runtimes on the tiny models converted (:func:`tests.backends.conftest.converted`),
each skipped with the reason where it is not installed: llama.cpp (against a fresh
llama.cpp pass), ONNX Runtime GenAI and OpenVINO (against a fresh transformers pass over
the same weights). Those three run chains only: the tree tests skip them.

The transformers backend and its paged path also run in bfloat16 (``-bfloat16``), the dtype
``--dtype auto`` gives a bfloat16 model on a CPU with AMX, against a fresh bfloat16 pass
(:data:`BF16_TOLERANCE`).

Tolerance: float32 on CPU, max |difference| <= 1e-4 in logits (measured ~3e-7 on the
tiny models; incremental and full passes differ only by floating-point summation order;
the toy's are equal; ≈1e-5 for the ONNX and OpenVINO exports against transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from spececd.backends.base import Backend, Extend, sync
from spececd.core.verify import tree_paths
from spececd.errors import InputError
from tests.reference import LOGIT_TOLERANCE as TOLERANCE
from tests.support.conformance import difference, transformers_fresh, worst_difference
from tests.toy import ToyBackend, ToyModel

ARCHS = ["llama", "qwen2", "gpt2"]
# bfloat16 against a fresh bfloat16 pass: measured at most 0.031 (one bfloat16 step at
# logits of 4 to 8) on the tiny models, eager and paged; four steps allowed. A cache read
# stale or out of place differs by whole logits.
BF16_TOLERANCE = 0.125


@dataclass(frozen=True)
class Subject:
    """A backend under test and its reference: a fresh forward pass over some tokens,
    ``[len(tokens), vocab]``."""

    backend: Backend
    fresh: Callable[[list[int]], np.ndarray]
    trees: bool = True  # the backend attends over token trees (else: chains only)
    tolerance: float = TOLERANCE  # max |difference| in logits


# The other runtimes, each on converted tiny models: what it imports and how to install it.
RUNTIMES = {"llama.cpp": ("llama_cpp", "llama-cpp-python is not installed: pip install "
                                       "'spececd[llama]'"),
            "onnx": ("onnxruntime_genai", "ONNX Runtime GenAI is not installed: pip install "
                                          "'spececd[onnx]'"),
            "openvino": ("openvino", "OpenVINO is not installed: pip install "
                                     "'spececd[openvino]'")}
CONVERTED = ["llama.cpp-llama", "onnx-llama", "onnx-qwen2", "openvino-llama",
             "openvino-qwen2"]


# The built-in runner's packed, paged path, as off CUDA, and with the fixed shapes that CUDA
# graphs are captured for (padded rows and widths, whole contexts), eagerly.
PAGED = [*(f"{arch}-paged" for arch in ARCHS), "llama-paged-fixed", "gpt2-paged-fixed"]


# In bfloat16, the dtype ``--dtype auto`` runs a bfloat16 model in on a CPU with AMX (and on
# a GPU): against a fresh bfloat16 pass (BF16_TOLERANCE).
BF16 = ["llama-bfloat16", "llama-paged-bfloat16", "llama-paged-fixed-bfloat16"]


@pytest.fixture(params=["toy", *ARCHS, *PAGED, *CONVERTED, *BF16])
def subject(request: pytest.FixtureRequest) -> Subject:
    if request.param == "toy":
        toy = ToyBackend(ToyModel(seed=5))
        return Subject(toy, toy.model.forward)
    torch = pytest.importorskip("torch")
    from spececd.backends.registry import load_backend

    tiny_models: dict[str, Path] = request.getfixturevalue("tiny_models")
    runtime, _, name = request.param.partition("-")
    if runtime in RUNTIMES:
        pytest.importorskip(RUNTIMES[runtime][0], reason=RUNTIMES[runtime][1])
        converted = request.getfixturevalue("converted")
        folder = converted("gguf" if runtime == "llama.cpp" else runtime, name)
        backend = load_backend(str(folder), device="cpu")
        if runtime == "llama.cpp":  # a GGUF's own kernels: against a fresh llama.cpp pass
            again = backend.new_sequence()

            def fresh_llama(tokens: list[int]) -> np.ndarray:
                again.truncate(0)
                return again.extend(tokens)

            return Subject(backend, fresh_llama, trees=False)
        return Subject(backend, transformers_fresh(tiny_models[name]), trees=False)
    name, bf16 = request.param.removesuffix("-bfloat16"), request.param.endswith("-bfloat16")
    arch, _, path = name.partition("-")
    dtype = "bfloat16" if bf16 else "float32"
    backend = load_backend(str(tiny_models[arch]), device="cpu", dtype=dtype)
    model = backend.model  # type: ignore[attr-defined]
    if path:
        from spececd.backends.hf import HFBackend
        from spececd.backends.paged import PagedBackend

        assert isinstance(backend, HFBackend)
        backend = PagedBackend(backend, max_context=200, fixed=path == "paged-fixed")

    def fresh(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float().numpy()  # type: ignore[no-any-return]

    return Subject(backend, fresh, tolerance=BF16_TOLERANCE if bf16 else TOLERANCE)


def test_extend_truncate_match_a_fresh_forward(subject: Subject) -> None:
    backend = subject.backend
    worst = worst_difference(backend, subject.fresh, seed=len(backend.description))
    print(f"{backend.description}: max |logit difference| {worst:.2e}")
    assert worst <= subject.tolerance, worst


def trees_of(subject: Subject) -> Backend:
    """The subject's backend, which declares tree attention as the subject says; a
    chains-only one skips the test."""
    assert subject.backend.tree_attention == subject.trees
    if not subject.trees:
        pytest.skip(f"{subject.backend.name} runs chains only")
    return subject.backend


def random_tree(rng: np.random.Generator, n: int, first: int = -1) -> list[int]:
    """Parents of a random tree of ``n`` nodes; the roots' parent is ``first``."""
    return [first if i == 0 or rng.random() < 0.3 else int(rng.integers(0, i))
            for i in range(n)]


def test_a_tree_extend_gives_each_node_its_paths_logits(subject: Subject) -> None:
    """Each node of a tree sees the cache and its ancestors only; keeping one path
    (a gather) leaves the cache a fresh forward over that path would build."""
    backend = trees_of(subject)
    rng = np.random.default_rng(11)
    worst = 0.0
    seq = backend.new_sequence()
    prefix = [int(t) for t in rng.integers(0, backend.vocab_size, size=9)]
    seq.extend(prefix, keep=0)
    for _ in range(3):
        n = int(rng.integers(4, 10))
        ids = [int(t) for t in rng.integers(0, backend.vocab_size, size=n)]
        parents = random_tree(rng, n)
        logits = seq.extend(ids, parents=parents)
        paths = tree_paths(parents)
        for node, path in enumerate(paths):
            expected = subject.fresh([*prefix, *(ids[i] for i in path)])[-1]
            worst = max(worst, difference(logits[node], expected))
        kept = paths[int(rng.integers(0, n))]
        seq.select(len(prefix), [len(prefix) + i for i in kept])
        prefix = [*prefix, *(ids[i] for i in kept)]
        assert seq.tokens == prefix
        after = [int(t) for t in rng.integers(0, backend.vocab_size, size=2)]
        logits = seq.extend(after)
        expected = subject.fresh([*prefix, *after])[-2:]
        worst = max(worst, difference(logits, expected))
        prefix = [*prefix, *after]
    print(f"{backend.description}: tree max |logit difference| {worst:.2e}")
    assert worst <= subject.tolerance, worst


def test_batched_trees_match_separate_extends(subject: Subject) -> None:
    """A batch mixing trees and chains over caches of different lengths."""
    backend = trees_of(subject)
    rng = np.random.default_rng(3)
    items, references = [], []
    for cached, n, tree in ((0, 5, True), (7, 3, False), (12, 8, True)):
        stream = [int(t) for t in rng.integers(0, backend.vocab_size, size=cached + n)]
        parents = [-1, *(p + 1 for p in random_tree(rng, n - 1))] if tree else None
        pair = []
        for _ in range(2):
            seq = backend.new_sequence()
            if cached:
                seq.extend(stream[:cached], keep=0)
            pair.append(seq)
        items.append(Extend(pair[0], stream[cached:], n, parents))
        references.append(pair[1].extend(stream[cached:], None, parents))
    results = backend.extend_batch(items)
    worst = max(difference(a, b) for a, b in zip(results, references, strict=True))
    print(f"{backend.description}: batched tree max |logit difference| {worst:.2e}")
    assert worst <= subject.tolerance, worst
    assert [len(item.sequence.tokens) for item in items] == [5, 10, 20]


def test_sync_keeps_the_shared_prefix() -> None:
    seq = ToyBackend(ToyModel()).new_sequence()
    seq.extend([5, 6, 7, 8, 9])
    assert sync(seq, [5, 6, 7, 10, 11]) == [10, 11]
    assert seq.tokens == [5, 6, 7]
    assert sync(seq, [5, 6, 7]) == [7]  # the last context token is always fed again
    assert seq.tokens == [5, 6]


def test_unknown_model_path_is_an_input_error(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # without it, the error says to install it
    from spececd.backends.registry import load_backend

    with pytest.raises(InputError, match="not found"):
        load_backend(str(tmp_path / "missing"))
    with pytest.raises(InputError, match=r"config\.json"):
        load_backend(str(tmp_path))


def test_missing_cuda_falls_back_to_cpu_with_a_notice(tiny_models: dict[str, Path],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    from spececd.backends.registry import load_backend

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; there is no fallback to observe")
    backend = load_backend(str(tiny_models["llama"]), device="cuda", dtype="float32")
    assert backend.model.device.type == "cpu"  # type: ignore[attr-defined]
    assert any("falling back to cpu" in r.message for r in caplog.records)


def test_batched_extend_matches_separate_extends(subject: Subject) -> None:
    backend = subject.backend
    rng = np.random.default_rng(7)
    streams = [[int(t) for t in rng.integers(0, backend.vocab_size, size=60)] for _ in range(4)]
    sequences = [backend.new_sequence() for _ in streams]
    done = [0, 5, 17, 0]  # different cached lengths, one empty
    for seq, stream, n in zip(sequences, streams, done, strict=True):
        if n:
            seq.extend(stream[:n], keep=0)
    worst = 0.0
    for _ in range(3):
        adds = [int(rng.integers(1, 7)) for _ in streams]
        items = [Extend(seq, stream[len(seq.tokens):len(seq.tokens) + add], add)
                 for seq, stream, add in zip(sequences, streams, adds, strict=True)]
        results = backend.extend_batch(items)
        for seq, stream, logits in zip(sequences, streams, results, strict=True):
            expected = subject.fresh(stream[:len(seq.tokens)])[-logits.shape[0]:]
            worst = max(worst, difference(logits, expected))
    print(f"{backend.description}: batched max |logit difference| {worst:.2e}")
    assert worst <= subject.tolerance, worst


def test_a_prompt_prefilled_in_chunks_gives_the_logits_of_a_whole_prefill(
        subject: Subject) -> None:
    """The token budget prefills prompts in chunks (``keep=0`` extends, several sequences'
    chunks of different sizes batched together, :mod:`spececd.cloud.scheduler`); the
    verification after them must see what it sees after one whole prefill."""
    backend = subject.backend
    rng = np.random.default_rng(23)
    prompts = [[int(t) for t in rng.integers(0, backend.vocab_size, size=n)] for n in (90, 57)]
    draft = [int(t) for t in rng.integers(0, backend.vocab_size, size=4)]
    chunked = [backend.new_sequence() for _ in prompts]
    for sizes in ((17, 9), (33, 40), (39, 7)):  # the chunks of each pass: both prompts'
        items = [Extend(seq, prompt[len(seq.tokens):min(len(seq.tokens) + size,
                                                        len(prompt) - 1)], 0)
                 for seq, prompt, size in zip(chunked, prompts, sizes, strict=True)]
        assert all(len(out) == 0 for out in backend.extend_batch(
            [item for item in items if item.ids]))
    assert [len(seq.tokens) for seq in chunked] == [len(p) - 1 for p in prompts]
    worst = 0.0
    for seq, prompt in zip(chunked, prompts, strict=True):
        whole = backend.new_sequence()
        whole.extend(prompt[:-1], keep=0)
        expected = whole.extend([prompt[-1], *draft])
        logits = seq.extend([prompt[-1], *draft])
        worst = max(worst, difference(logits, expected),
                    difference(logits, subject.fresh([*prompt, *draft])[-5:]))
    print(f"{backend.description}: chunked prefill max |logit difference| {worst:.2e}")
    assert worst <= subject.tolerance, worst
