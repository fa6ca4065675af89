"""Backend conformance: after any sequence of extend/truncate calls, ``extend`` returns the
logits a fresh forward pass over the same tokens gives.

Tolerance: float32 on CPU, max |difference| <= 1e-4 in logits (measured ~3e-7 on the
tiny models; incremental and full passes differ only by floating-point summation order).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spececd.backends.base import sync  # noqa: E402
from spececd.backends.registry import load_backend  # noqa: E402
from spececd.errors import InputError  # noqa: E402

TOLERANCE = 1e-4
ARCHS = ["llama", "qwen2", "gpt2"]


def fresh_logits(backend: object, tokens: list[int]) -> np.ndarray:
    model = backend.model  # type: ignore[attr-defined]
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()  # type: ignore[no-any-return]


@pytest.mark.parametrize("arch", ARCHS)
def test_extend_truncate_match_a_fresh_forward(arch: str, tiny_models: dict[str, Path]) -> None:
    backend = load_backend(str(tiny_models[arch]), device="cpu", dtype="float32")
    rng = np.random.default_rng(hash(arch) % 2**32)
    tokens = [int(t) for t in rng.integers(0, backend.vocab_size, size=120)]
    seq = backend.new_sequence()
    worst = 0.0
    for _ in range(25):
        if seq.tokens and rng.random() < 0.4:
            seq.truncate(int(rng.integers(0, len(seq.tokens) + 1)))
            continue
        n = len(seq.tokens)
        add = int(rng.integers(1, 9))
        new = [int(t) for t in rng.integers(0, backend.vocab_size, size=add)]
        tokens[n:n + add] = new
        keep = int(rng.integers(0, add + 1)) if rng.random() < 0.5 else None
        logits = seq.extend(new, keep=keep)
        assert seq.tokens == tokens[:n + add]
        expected = fresh_logits(backend, tokens[:n + add])[n:]
        expected = expected if keep is None else expected[add - keep:]
        assert logits.shape == expected.shape
        if logits.size:
            worst = max(worst, float(np.abs(logits - expected).max()))
    print(f"{arch}: max |logit difference| {worst:.2e}")
    assert worst <= TOLERANCE


def test_sync_keeps_the_shared_prefix(tiny_models: dict[str, Path]) -> None:
    backend = load_backend(str(tiny_models["llama"]), device="cpu", dtype="float32")
    seq = backend.new_sequence()
    seq.extend([5, 6, 7, 8, 9])
    assert sync(seq, [5, 6, 7, 10, 11]) == [10, 11]
    assert seq.tokens == [5, 6, 7]
    assert sync(seq, [5, 6, 7]) == [7]  # the last context token is always fed again
    assert seq.tokens == [5, 6]


def test_unknown_model_path_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        load_backend(str(tmp_path / "missing"))
    with pytest.raises(InputError, match=r"config\.json"):
        load_backend(str(tmp_path))


def test_missing_cuda_falls_back_to_cpu_with_a_notice(tiny_models: dict[str, Path],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; there is no fallback to observe")
    backend = load_backend(str(tiny_models["llama"]), device="cuda", dtype="float32")
    assert backend.model.device.type == "cpu"  # type: ignore[attr-defined]
    assert any("falling back to cpu" in r.message for r in caplog.records)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_extend_matches_separate_extends(arch: str,
                                                 tiny_models: dict[str, Path]) -> None:
    backend = load_backend(str(tiny_models[arch]), device="cpu", dtype="float32")
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
        items = [(seq, stream[len(seq.tokens):len(seq.tokens) + add], add)
                 for seq, stream, add in zip(sequences, streams, adds, strict=True)]
        results = backend.extend_batch(items)
        for seq, stream, logits in zip(sequences, streams, results, strict=True):
            expected = fresh_logits(backend, stream[:len(seq.tokens)])[-logits.shape[0]:]
            worst = max(worst, float(np.abs(logits - expected).max()))
    print(f"{arch}: batched max |logit difference| {worst:.2e}")
    assert worst <= TOLERANCE
